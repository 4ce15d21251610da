"""HuggingFace Llama-family attention patches for UPipe."""
