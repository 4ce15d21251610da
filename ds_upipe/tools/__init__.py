"""Tools on top of everything else: the ``ds-upipe`` CLI, the planner, the bench and the measurement
toolkit (peak memory, rank spawning, tiny model configs) that the bench, the planner's validation and
the tests share."""
