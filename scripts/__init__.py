"""The project's command-line scripts: training (``train``) and the benchmarks (``bench_*``).

Run them as modules from the repository root, e.g. ``python -m scripts.train --help`` or
``python -m scripts.bench_rok --tiny --steps 2 --no-probe``. ``training`` holds the training
step of the models in ``models/`` (its config, train state, sharding, profiling and
checkpoints) and ``data`` its token batch sources, which ``train`` and the benchmarks share;
``bench_common`` what the benchmarks share; ``gpu.sh`` runs them on a GPU machine (see
BENCHMARKS.md, "Reproducing").
"""
