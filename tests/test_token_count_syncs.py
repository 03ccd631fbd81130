"""A CUDA token count (`normalize="tokens"`) is copied to the host once per micro-batch, and its
checks read the copy: before, it was read three times, each a host synchronisation (found in
review of issue #13's "no host synchronisation inside the step but the one agreement")."""

import warnings

import pytest
import torch

import fzero
from fzero._src.step import _objective


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a cuda count: needs a GPU")
def test_a_cuda_token_count_is_read_by_the_host_once():
    config = fzero.train_step(lambda p, b: (p["w"].sum(), 1.0), normalize="tokens").config
    loss_sum = torch.ones((), device="cuda", requires_grad=True)
    count = torch.tensor(7.0, device="cuda")
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:  # (setting the mode warns that it is a prototype)
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _, got = _objective(config, (loss_sum, count))
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in caught]
    assert got.device.type == "cpu" and got.dtype == torch.float64 and got.item() == 7.0


@pytest.mark.parametrize("count, ok", [(7, True), (7.5, True), (torch.tensor(3), True), (-1, False),
                                       (float("nan"), False), (torch.tensor([1.0, 2.0]), False)])
def test_the_count_checks_read_the_host_copy(count, ok):
    config = fzero.train_step(lambda p, b: (p["w"].sum(), 1.0), normalize="tokens").config
    loss_sum = torch.ones((), requires_grad=True)
    if ok:
        _, got = _objective(config, (loss_sum, count))
        assert got.dtype == torch.float64 and got.shape == () and got.item() == float(count)
    else:
        with pytest.raises(fzero.ConfigError, match="count loss_fn returned must be one finite number"):
            _objective(config, (loss_sum, count))
