"""Units and the paper's sequence lengths, shared by the planner's modules."""

GiB = 2**30
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
#: the paper's sequence lengths (tokens); 1K = 1024
PAPER_STEPS = [128 * 2**10, 256 * 2**10, 512 * 2**10, 2**20, 2 * 2**20, 3 * 2**20, 4 * 2**20, 5 * 2**20]
