from setuptools import find_packages, setup

setup(
    name="ds-upipe",
    version="0.1.0",
    description="UPipe (headwise-chunked Ulysses) memory-efficient sequence parallelism for DeepSpeed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["ds_upipe", "ds_upipe.*", "hf_patches", "hf_patches.*"]),
    install_requires=[
        # torch first on CPU machines (see README): these ranges admit the installed CPU build.
        "torch>=2.6",
        "deepspeed>=0.19.7,<0.21",
        "transformers>=5,<6",
        "accelerate>=1.12,<2",
        "pydantic>=2,<3",
        "tqdm",
        "numpy",
        "ninja",
    ],
    extras_require={
        # the releases whose private call signatures ds_upipe.kernels.FlashAttnKernel adapts to
        "flash": ["flash-attn>=2.6,<2.9"],
        "bench": ["matplotlib>=3.7"],
        "test": ["pytest>=8", "ruff>=0.6", "matplotlib>=3.7", "peft>=0.13", "trl==1.16.0"],
    },
    entry_points={"console_scripts": ["ds-upipe=ds_upipe.tools.cli:main"]},
)
