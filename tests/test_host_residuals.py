"""Error-feedback residuals kept on the host (``residuals="host"``): the setting, its checks, and the
copies (:class:`~lightning_commstrats.buckets.Parking`). On CUDA (marked ``cuda``) the residuals wait
in pinned memory and training is bit for bit that with them on the device; the real ranks' test is
tests/multiprocess/test_host_residuals_ranks.py."""

import pytest
import torch

import lightning_commstrats as lc
from lightning_commstrats.buckets import Parking
from lightning_commstrats.comm.base import LocalCommunicator
from lightning_commstrats.compression.aggregation import QuantizedAllReduce
from lightning_commstrats.compression.exchange import GradientCompression
from lightning_commstrats.compression.hierarchical import SlowHop
from lightning_commstrats.compression.quantizers import ColumnCodec
from lightning_commstrats.strategies.reducer import Reducer

CHOICES = r"choose one of \('device', 'host'\)"
# the schemes whose compressed exchange keeps error-feedback residuals: each takes residuals= for all of them
GRADIENT_SCHEMES = {
    "onebit_sgd": lc.OneBitSGDStrategy,
    "onebit_adam": lc.OneBitAdamStrategy,
    "zero_one_adam": lc.ZeroOneAdamStrategy,
}


def test_a_bad_residuals_setting_is_refused_at_construction_naming_the_argument():
    for scheme in GRADIENT_SCHEMES.values():
        with pytest.raises(ValueError, match=rf"residuals='gpu' is not supported; {CHOICES}"):
            scheme(residuals="gpu")
    with pytest.raises(ValueError, match=rf"residuals='cuda' is not supported; {CHOICES}"):
        GradientCompression(1, residuals="cuda")
    with pytest.raises(ValueError, match=rf"residuals=None is not supported; {CHOICES}"):
        Reducer(25.0, residuals=None)
    with pytest.raises(ValueError, match=rf"residuals='pinned' is not supported; {CHOICES}"):
        SlowHop(LocalCommunicator(), 4, residuals="pinned")


@pytest.mark.parametrize("scheme", GRADIENT_SCHEMES)
def test_host_residuals_reach_every_holder_of_a_gradient_scheme(scheme):
    make = GRADIENT_SCHEMES[scheme]
    strategy = make(num_quantization_bits=1, residuals="host")
    assert strategy.residuals == "host" and strategy.reducer.residuals == "host"
    assert strategy.reducer.home == torch.device("cpu")
    # the 1-bit exchange's (of the gradient, or of Adam's momentum) as well as the slow hop's
    exchange = strategy.compression.bind(LocalCommunicator(), 25.0)
    assert exchange.quantized.home == torch.device("cpu")
    on_device = make(num_quantization_bits=1)
    assert on_device.residuals == "device" and on_device.reducer.home is None
    assert on_device.compression.bind(LocalCommunicator(), 25.0).quantized.home is None
    # the reducer sets its hop's at connect, and after
    hop = SlowHop(LocalCommunicator(), 4, hold=True)
    reducer = Reducer(25.0, residuals="host")
    reducer.connect(LocalCommunicator(), LocalCommunicator(), hop)
    assert hop.residuals == "host"
    reducer.residuals = "device"
    assert hop.residuals == "device"


@pytest.mark.parametrize(
    "make", [lc.SampledVocabStrategy, lc.ExpertParallelStrategy], ids=["sampled_vocab", "expert_parallel"]
)
def test_the_other_compressed_exchanges_keep_their_residuals_where_residuals_says(make):
    for where, home in (("host", torch.device("cpu")), ("device", None)):
        strategy = make(num_quantization_bits=1, residuals=where)
        assert strategy.reducer.residuals == where
        assert strategy.compression.bind(LocalCommunicator(), 25.0).quantized.home == home


def test_a_periodic_scheme_refuses_residuals_apart_from_its_outer_state():
    with pytest.raises(ValueError, match=r"residuals='host' with outer_state='device'.*set outer_state"):
        lc.DiLoCoStrategy(sync_period=2, outer_state="device", residuals="host")
    assert lc.DiLoCoStrategy(sync_period=2, outer_state="host", residuals="host").reducer.residuals == "host"
    assert lc.DiLoCoStrategy(sync_period=2, outer_state="device").reducer.residuals == "device"
    # "device", the base's default, is what the CLI passes when the setting is not given: it follows outer_state
    assert lc.DiLoCoStrategy(sync_period=2, outer_state="host", residuals="device").residuals == "host"


def test_on_a_cpu_run_the_host_is_the_device_and_nothing_is_copied():
    parking = Parking(torch.device("cpu"))
    t = torch.arange(6.0)
    assert parking.park(t) is t and parking.visit(t, torch.device("cpu")) is t
    assert parking.park_all({"a": t})["a"] is t
    parking.settle()  # nothing to wait for


def _quantized_run(device: torch.device, home: torch.device | None, steps: int = 3) -> tuple[list, dict]:
    q = QuantizedAllReduce(ColumnCodec(1), LocalCommunicator())
    q.home = home
    g = torch.Generator().manual_seed(0)
    outs = []
    for _ in range(steps):
        grads = {"w": torch.randn(64, 48, generator=g).to(device), "v": torch.randn(40, 32, generator=g).to(device)}
        outs.append({k: v.cpu() for k, v in q(grads).items()})
    return outs, q.state_dict()


@pytest.mark.cuda
def test_residuals_wait_pinned_on_the_host_and_the_results_are_bit_for_bit_those_on_the_device():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cuda = torch.device("cuda")
    on_device, device_state = _quantized_run(cuda, None)
    on_host, host_state = _quantized_run(cuda, torch.device("cpu"))
    for a, b in zip(on_device, on_host, strict=True):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    for kind in ("residuals", "residuals2"):
        for name, res in host_state[kind].items():
            assert res.device.type == "cpu" and res.is_pinned(), (kind, name)
            assert torch.equal(res, device_state[kind][name].cpu()), (kind, name)
        assert all(r.is_cuda for r in device_state[kind].values())


@pytest.mark.cuda
def test_parked_copies_leave_the_host_free_and_are_ordered_on_the_streams():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    parking = Parking(torch.device("cpu"))
    made = torch.randn(1 << 20, device="cuda")
    expected = made.cpu()
    kept = parking.park_all({"r": made * 1})["r"]
    assert kept.is_pinned() and parking._parked is not None  # an event, not a synchronisation
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # a visit from another stream waits for the park on the device
        back = parking.visit(kept, made.device)
    torch.cuda.synchronize()
    assert torch.equal(back.cpu(), expected)
    parking.settle()
    assert torch.equal(kept, expected) and parking._parked is None
