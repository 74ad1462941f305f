"""Test session setup: the README command's selection, GPU tests skipped without a GPU, no test
left with the store shut down, and JAX's caches emptied after each test file."""

import pytest

# The slower variants of test families whose other variants stay in the README's test command
# (`pytest -m slow`, which CI runs, runs these): the command keeps one of each guarantee. Each
# entry is a node id or the start of one (the reliability tests' ids hold the error's text); an
# entry that matches no test of a collected file is an error, not a silent no-op.
SLOW_VARIANTS = (
  # the same store-equals-device guarantee as the kept variant: nvme-host (stream_scan), the
  # host tier (llama, layer-stream checkpoints, trainer resume), host (offload_optimizer)
  "tests/test_stream_scan.py::test_store_equals_device_bit_for_bit[host-device]",
  "tests/test_llama.py::test_offloaded_tags_equal_device[nvme]",
  "tests/test_layer_stream_checkpoint.py::test_resume_equals_never_stopping[host]",
  "tests/test_trainer.py::test_resume_through_the_trainer_equals_never_stopping[nvme]",
  *(
    f"tests/test_optimizer.py::test_matches_the_transformation_on_the_device[nvme-{tx}]"
    for tx in ("chain", "lion", "sgd_momentum", "shared_trace")
  ),
  "tests/test_optimizer.py::test_apply_gradients_updates_the_parameters_in_place[chain]",
  "tests/test_optimizer.py::test_apply_gradients_updates_the_parameters_in_place[sgd_momentum]",
  # optax's own list: the kept cases cover each kind of state; the rest of it runs in the slow
  # leg with these
  *(
    f"tests/test_optax_suite.py::test_optax_list_streams_like_the_device[{case}]"
    for case in (
      "prodigy",
      "muon",
      "lamb@mixed",
      "cocob",
      "sgd+mechanize[learning_rate=0.1]",
      "schedule_free_adamw",
      "galore",
    )
  ),
  "tests/test_optax_suite.py::test_files_stream_like_the_device[adafactor[learning_rate=0.005]-host,nvme]",
  "tests/test_optax_suite.py::test_files_stream_like_the_device[adam[mu_dtype=bfloat16]-host,nvme]",
  "tests/test_optax_suite.py::test_files_stream_like_the_device[chain(clip_by_global_norm,adam)-host,nvme]",
  "tests/test_optax_suite.py::test_files_stream_like_the_device[novograd-host,nvme]",
  # the same failure injected at another count or errno (the kept ones: EIO both ways, ENOSPC)
  "tests/test_reliability.py::test_injected_io_error[read:2:EROFS",
  "tests/test_reliability.py::test_short_transfers_are_retried[shortread:3:0]",
  "tests/test_reliability.py::test_short_transfers_are_retried[shortwrite:2:0]",
  # the race's other variant (kept: the stack made before shutdown(), over the same processes)
  "tests/test_user_traps.py::test_a_stack_made_before_configure_is_refused_the_same_way_in_every_process[configure]",
  # end to end through a whole step, covered in the command by the trainer's device-reference
  # step, the models' tiny training and scripts.train's progress test
  "tests/test_layer_stream.py::test_update_store_equals_device_bit_for_bit[host]",
  "tests/test_layer_stream.py::test_update_in_place_with_master_weights_replaces_the_parameters",
  "tests/test_models.py::test_master_weights_in_the_store_train",
  "tests/test_models.py::test_untied_embeddings_and_other_positions[t5]",
  "tests/test_optimizer.py::test_one_device_train_step_compiles_once",
  "tests/test_train.py::test_cli_default_offload_run_and_restore",
  # bfloat16 within tolerance of value_and_grad (kept: float32, bit for bit with it)
  "tests/test_layer_stream.py::test_bfloat16_within_tolerance_of_value_and_grad",
  # JAX's own pinned-host offload of the optimizer state: the long-context benchmark's
  # comparison, not the library's
  "tests/test_models.py::test_jax_pinned_host_optimizer_state_trains_as_on_the_device",
  # two pages' examples (the disk probe and stats(); profile and plan), which
  # tests/test_probe.py, test_offload.py and test_planner.py exercise in the command
  "tests/test_docs.py::test_page_examples_run[performance.md]",
  "tests/test_docs.py::test_page_examples_run[planner.md]",
  # the layer stream's page (a minute: its examples train; test_layer_stream.py and
  # test_stream_scan.py run the same calls in the command)
  "tests/test_docs.py::test_page_examples_run[layer_stream.md]",
  # which policies spare cuDNN attention's forward pass: kept, the attn tag's and the policy's
  "tests/test_llama.py::test_which_policies_spare_attentions_forward_pass[layer_in]",
  "tests/test_llama.py::test_which_policies_spare_attentions_forward_pass[four_tags]",
)


def _mark_slow_variants(config, items) -> None:
  """Marks SLOW_VARIANTS slow. An entry whose test function is not in its collected file is an
  error; so is one that matches no variant where the whole of its file was collected (no node id
  or ``-k`` narrowed it)."""
  some_item = {}
  for item in items:
    some_item.setdefault(item.nodeid.split("::")[0], item)
  narrowed = any("::" in str(arg) for arg in config.args) or bool(config.option.keyword)
  for entry in SLOW_VARIANTS:
    matched = [item for item in items if item.nodeid.startswith(entry)]
    for item in matched:
      item.add_marker(pytest.mark.slow)
    path, _, rest = entry.partition("::")
    item = some_item.get(path)
    if item is None or matched:
      continue
    if not hasattr(item.module, rest.split("[")[0]):
      raise pytest.UsageError(f"tests/conftest.py SLOW_VARIANTS: {entry!r}: no such test")
    if not narrowed:
      raise pytest.UsageError(f"tests/conftest.py SLOW_VARIANTS: {entry!r} matches no test")


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks
def pytest_collection_modifyitems(config, items):
  from _common import gpus

  _mark_slow_variants(config, items)
  if gpus():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(autouse=True)
def _store_not_left_shut_down():
  """A test that ends with ``ssd.shutdown()`` leaves the process shut down, where nothing opens
  a store by itself: the next test starts as a fresh process does, never configured."""
  yield
  import sys

  config = sys.modules.get("jax_ssdtrain._src.config")
  if config is not None and config.is_shut_down():
    config.reset_to_unconfigured()


@pytest.fixture(autouse=True, scope="module")
def _jax_caches_emptied_after_each_file():
  """A test process runs many files (CI's slow leg: some 490 tests over two workers, MaxText's
  trainer among them) and otherwise keeps the compiled programs and traces of every file before:
  once, near its end, a single process aborted inside XLA's compiler (a test that passes alone),
  most likely for memory. No two test files share a program, so each file starts as it would
  alone."""
  yield
  import gc
  import sys

  jax = sys.modules.get("jax")
  if jax is not None:
    jax.clear_caches()
  gc.collect()
