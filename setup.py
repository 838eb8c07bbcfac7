"""OmniBal-Megatron: balanced 3D-parallel VLM instruction tuning on megatron-core."""
from setuptools import find_namespace_packages, setup

setup(
    name="omnibal-megatron",
    version="0.1.0",
    description="OmniBal (ICML 2025) data/model/memory balancing for VLM training on megatron-core",
    python_requires=">=3.10",
    packages=find_namespace_packages(include=["omnibal_ext*", "megatron.training*", "megatron.vlm*"]),
    py_modules=["pretrain_vlm", "omnibal_cli"],
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "einops==0.8.2",
        "numpy>=1.26,<3",
        "pillow==13.0.0",
        "scikit-learn==1.9.1",
        "matplotlib==3.11.2",
        "tqdm==4.70.1",
        "xxhash==4.1.0",  # checkpoint file checksums
        "av==18.1.0",  # PyAV: video decoding in the data loader (the newest the registry serves)
        # Energon datasets (--data-path a WebDataset folder or metadataset); its base install pulls no torchvision
        "megatron-energon==7.4.1",
        "pyyaml==6.0.3",  # reading .nv-meta/dataset.yaml and writing metadatasets (also Energon's)
    ],
    extras_require={
        "tensorboard": ["tensorboard==2.21.0"],
        # transformers is the reference implementation the Hugging Face tests compare against
        # the `openai` client is the reference client of `omnibal serve`'s tests
        # pytest-xdist: the suite runs in two test processes (pytest.ini, docs/testing.md)
        "test": ["pytest==9.0.3", "pytest-xdist==3.8.0", "hypothesis==6.155.2", "transformers==5.23.0",
                 "openai==3.57.0", "fastapi==0.165.0", "uvicorn==0.55.0"],
        # `omnibal serve`: the OpenAI-compatible HTTP server (docs/generation.md#serving says why these)
        "serve": ["fastapi==0.165.0", "uvicorn==0.55.0"],
        # GPU extras are installed by the user from NVIDIA's channels (transformer-engine, NVIDIA apex
        # built from source); never the unrelated PyPI package called "apex".
        "hf": ["transformers==5.23.0"],
    },
    entry_points={"console_scripts": ["omnibal=omnibal_cli:main"]},
)
