"""Test set-up: 8 simulated CPU devices, set before JAX initialises, and one compilation cache for
the whole run.

The cache: many tests compile the same program (the tiny Llama's step under one layout, built by
another Trainer, or in a subprocess that `jaxpar train` starts). JAX's persistent compilation cache
keys programs by their HLO, so each is compiled once per run. The directory is made by the first
process that imports this file (pytest, or its xdist controller) and handed to the workers and
every subprocess through the environment; it is removed when the run ends.
"""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

# LLVM optimisation level 0: the suite's programs are small and compiled once each, so compiling
# dominates. Measured on the whole suite (2026-12-02, 865 tests): 988 s and 1886 s of CPU at level
# 0 against 1084 s and 2098 s at level 1; compile-bound files take 0.6-0.8 of their time, the
# long-running ones (examples, the main job, checkpoints) 1.2-1.45 of it. The examples, which
# train for many steps in processes of their own, keep level 1 (``run_example``: measured alone,
# test_examples.py 72 s at level 1 against 145 s at level 0).
# And XLA:CPU's older loop emitters instead of its fusion emitters: a tiny Llama step compiles in
# 0.8 s of CPU instead of 2.8 s, and test_equivalence.py takes 58 s of CPU instead of 103 s
# (2026-12-06); programs that run many steps run slower with them (the examples: 131 s against
# 89 s), so ``run_example`` leaves both out.
COMPILE_QUICKLY, RUN_QUICKLY = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=1"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {COMPILE_QUICKLY}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxpar-test-compilation-cache-")
    os.environ["JAXPAR_TEST_OWNS_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # small programs too: the suite has hundreds
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


# The README's command hands whole files to 3 workers (--dist loadfile) in collection order
# (--no-loadscope-reorder; xdist's default order is by number of tests, which started the few-test,
# long files last and left one worker running them alone at the end). The longest files start
# first, roughly longest first (seconds of one worker in a full run, measured here).
LONGEST_FIRST = ["test_compile.py", "test_expert_parallel.py", "test_equivalence.py", "test_readme.py", "test_planner.py",
                 "test_examples.py", "test_pipeline.py", "test_federated.py", "test_context.py",
                 "test_any_model.py", "test_analysis_report.py", "test_compressed.py", "test_grad_sync.py", "test_multihost.py",
                 "test_decoupled.py", "test_checkpoint.py", "test_main_job.py", "test_generate_cli.py", "test_corpus.py",
                 "test_convert.py", "test_mpmd.py", "test_kernels_ring.py",
                 "test_bd3lm_sampler.py", "test_bd3lm.py", "test_block_parallel.py", "test_llama_decode.py", "test_delayed_tp.py",
                 "test_check.py", "test_experts.py", "test_dcp.py", "test_kernels_quantize.py", "test_axonn.py", "test_wheel.py", "test_attention.py",
                 "test_collective_matmul.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order kept


def pytest_sessionfinish(session):
    owned = os.environ.get("JAXPAR_TEST_OWNS_CACHE")
    if owned and not hasattr(session.config, "workerinput"):  # the controller, after every worker is done
        shutil.rmtree(owned, ignore_errors=True)


def run_example(script: str, *args: str, compile_bound: bool = False) -> str:
    """Run examples/``script`` on 8 simulated CPU devices; its output, once it has exited 0.
    ``compile_bound``: it runs a few steps of several programs, so it keeps the suite's quick
    compiles (``COMPILE_QUICKLY``) rather than the examples' ``RUN_QUICKLY``."""
    root = pathlib.Path(__file__).resolve().parent.parent
    flags = os.environ["XLA_FLAGS"] if compile_bound else os.environ["XLA_FLAGS"].replace(COMPILE_QUICKLY, RUN_QUICKLY)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    result = subprocess.run([sys.executable, f"examples/{script}", *args], cwd=root, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{script} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def trimmed_copy(source, target, last_step: int):
    """A copy of checkpoint directory ``source`` holding its checkpoints up to ``last_step``, and
    not its lock: what a run interrupted after ``last_step`` would have left."""
    shutil.copytree(source, target, ignore=lambda d, names: [n for n in names if os.path.samefile(d, source) and
                                                             (n == "jaxpar.lock" or (n.isdigit() and int(n) > last_step))])
