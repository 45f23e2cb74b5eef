"""moe_jax: sparse MoE language models with hybrid KDA / MLA attention in JAX."""

from setuptools import find_packages, setup

# data.tokenizer = sentencepiece:/hf: and the parquet source (array_record comes with grain).
DATA = ["sentencepiece==0.2.3", "tokenizers==0.23.3", "pyarrow==26.0.1"]
# Hugging Face Kimi Linear checkpoints in and out (moe_jax/interop), Kimi's tiktoken tokenizer.
HF = ["safetensors==0.8.0", "tiktoken==0.14.0"]
# notebooks/: executed top to bottom by tests/test_notebooks.py.
NOTEBOOKS = ["matplotlib==3.11.2", "nbformat==5.11.1", "nbclient==0.11.0", "ipykernel==7.4.0"]

setup(
    name="moe_jax",
    version="0.1.0",
    description="Sparse Mixture-of-Experts LMs with hybrid linear attention (JAX/Flax/Pallas).",
    packages=find_packages(include=["moe_jax", "moe_jax.*", "pallas_kernels",
                                    "pallas_kernels.*", "configs", "configs.*"]),
    # The grouped matmul's tile table (pallas_kernels/moe/mosaic_gpu_grouped.py reads it).
    package_data={"pallas_kernels.moe": ["mosaic_gpu_grouped_tuned.json"]},
    python_requires=">=3.12",
    install_requires=[
        "jax==0.11.2",
        "jaxlib==0.11.2",
        "flax==0.12.10",
        "optax==0.2.8",
        "orbax-checkpoint==0.12.4",
        "grain==0.2.18",
        "ml-collections==1.1.0",
        "absl-py>=2.1",
        "tqdm>=4.66",
        "tensorboardX==2.6.5",
        "numpy>=2.0",
        "flatbuffers>=24",   # jax.export serialization (train/compile_cache.py)
    ],
    extras_require={
        # The tests use every extra below but the accelerator ones: the digits image task,
        # the learned tokenizers and corpus formats, and the notebooks (run by nbclient);
        # tokamax for the comparison with its Mosaic TPU KDA (interpreted on CPU); triton
        # (the GPU machine's 3.6) for KDA's native Triton kernel, run by its interpreter on
        # CPU and compiled for sm_90a (ptxas) to check it builds for the H200.
        "dev": ["pytest>=8", "pytest-xdist>=3.5", "matplotlib==3.11.2", "scikit-learn==1.9.1",
                "tokamax==0.0.17", "triton==3.6.0", *DATA, *HF, *NOTEBOOKS],
        "vision": ["scikit-learn==1.9.1", "pillow>=10"],   # image tasks, PNG prompts
        "data": DATA,
        "hf": HF,
        "notebooks": NOTEBOOKS,
        # CUDA wheels for jaxlib; tokamax's grouped matmul is imported lazily (heavy deps).
        # jax-triton calls KDA's native Triton kernel (implementation="triton").
        "gpu": ["jax[cuda13]==0.11.2", "tokamax==0.0.17", "triton==3.6.0", "jax-triton==0.4.1"],
        "tpu": ["jax[tpu]==0.11.2", "tokamax==0.0.17"],
    },
)
