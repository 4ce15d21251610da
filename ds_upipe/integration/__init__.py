"""Integration layer: the ``"upipe"`` ds_config block, ``ds_upipe.initialize`` (DeepSpeed engine) and the
HF Trainer / ``accelerate launch`` path.  Sits above ``hf_patches``; imports DeepSpeed and pydantic."""
