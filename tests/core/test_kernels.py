"""The native skinny-batch Linear kernel (fedmosaic.kernels) against the torch path.

Every Linear shape of the model zoo (all registered families, gray and colour inputs), batches
1..64 (odd sizes, widths that are not multiples of 8), hand-computed values, determinism (run to
run and thread count), and the fallback. Skipped where the extension cannot be built.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedmosaic import kernels
from fedmosaic.accel.fused import FusedSGDLinears
from fedmosaic.core.registry import FAMILIES
from fedmosaic.core.training import AccelSettings, TrainSettings, train_epochs
from fedmosaic.kernels import conv as fast_conv
from fedmosaic.models import build_client_model, family_members

native = pytest.mark.skipif(kernels.load() is None, reason="native kernel not built here")


def zoo_linear_shapes() -> list[tuple[int, int]]:
    """(in, out) of every nn.Linear in every registered family, 1x28x28 and 3x32x32 inputs."""
    shapes: set[tuple[int, int]] = set()
    for fam in FAMILIES.names():
        for member in family_members(fam):
            for shape in ((1, 28, 28), (3, 32, 32)):
                with torch.device("meta"):  # shapes only: no parameter initialisation
                    model = build_client_model(member, shape, 10, 512)
                for m in model.modules():
                    if type(m) is nn.Linear:
                        shapes.add((m.in_features, m.out_features))
    return sorted(shapes)


def reference(x, w, b, dy, lr):  # float64: the exact answer both float32 paths approximate
    x, w, b, dy = (t.double() for t in (x, w, b, dy))
    return x @ w.t() + b, dy @ w, w - lr * dy.t() @ x, b - lr * dy.sum(0)


def close(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    # float32 dot products of length k: error grows like sqrt(k) eps * |terms|
    tol = 4e-7 * (k**0.5 + 4)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_hand_computed_step():
    if kernels.load() is None:
        pytest.skip("native kernel not built here")
    x = torch.tensor([[1.0, 2.0]])
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    b = torch.tensor([0.0, 0.0, 1.0])
    assert kernels.linear_forward(x, w, b).tolist() == [[1.0, 2.0, 4.0]]
    dx = kernels.linear_backward_sgd(torch.tensor([[1.0, 0.0, 1.0]]), x, w, b, 0.5, True)
    assert dx.tolist() == [[2.0, 1.0]]  # dy W with the old W
    assert w.tolist() == [[0.5, -1.0], [0.0, 1.0], [0.5, 0.0]]  # W - 0.5 dy^T x
    assert b.tolist() == [-0.5, 0.0, 0.5]


@native
def test_every_zoo_linear_shape_matches_the_torch_path():
    shapes = zoo_linear_shapes()
    assert (4608, 1024) in shapes and (6272, 1024) in shapes and (512, 10) in shapes
    gen = torch.Generator().manual_seed(0)
    checked = set()
    for n, (i, o) in enumerate(shapes):
        # every batch size 1..64 over the shapes, plus the simulator's batch 10
        for batch in sorted({1 + (n * 3) % 64, 1 + (n * 3 + 1) % 64, 10}):
            checked.add(batch)
            x = torch.randn(batch, i, generator=gen)
            w = torch.randn(o, i, generator=gen) / i**0.5
            b = torch.randn(o, generator=gen)
            dy = torch.randn(batch, o, generator=gen) / o**0.5
            y64, dx64, w64, b64 = reference(x, w, b, dy, 0.1)
            close(kernels.linear_forward(x, w, b), y64, i)
            close(F.linear(x, w, b), y64, i)  # the torch path meets the same bound
            wk, bk = w.clone(), b.clone()
            dx = kernels.linear_backward_sgd(dy, x, wk, bk, 0.1, True)
            close(dx, dx64, o)
            close(wk, w64, batch)
            close(bk, b64, batch)
            wn = w.clone()
            assert kernels.linear_backward_sgd(dy, x, wn, None, 0.1, False) is None
            assert torch.equal(wn, wk)  # the update does not depend on computing dx
    assert checked == set(range(1, 65))


def _avx512_here() -> bool:
    if kernels.load() is None:
        return False
    try:
        return kernels.set_isa("avx512") == "avx512"
    finally:
        kernels.set_isa("avx512")  # the default: AVX-512 where the CPU and torch have it


@pytest.mark.skipif(not _avx512_here(), reason="no AVX-512 here (or no native kernel)")
def test_avx512_code_gives_the_avx2_bits():
    """The 16-lane code does the AVX2 code's arithmetic element by element: same bits, for every
    zoo Linear shape, batches 1..64 (forward tails, odd row counts, column-tile tails)."""
    shapes = zoo_linear_shapes() + [(1, 1), (7, 5), (9, 17), (1001, 37), (24, 3)]
    gen = torch.Generator().manual_seed(5)
    batches = set()
    try:
        for n, (i, o) in enumerate(shapes):
            for batch in sorted({1 + (n * 5) % 64, 1 + (n * 5 + 2) % 64, 10}):
                batches.add(batch)
                x = torch.randn(batch, i, generator=gen)
                w0 = torch.randn(o, i, generator=gen) / i**0.5
                b0, dy = torch.randn(o, generator=gen), torch.randn(batch, o, generator=gen)
                outs = []
                for isa in ("avx2", "avx512"):
                    assert kernels.set_isa(isa) == isa
                    w, b = w0.clone(), b0.clone()
                    y = kernels.linear_forward(x, w, b)
                    dx = kernels.linear_backward_sgd(dy, x, w, b, 0.1, True)
                    outs.append((y, dx, w, b))
                for a, c in zip(*outs):
                    assert torch.equal(a, c), (i, o, batch)
    finally:
        kernels.set_isa("avx512")
    assert batches == set(range(1, 65))


@native
@pytest.mark.parametrize(("batch", "i", "o"), [(10, 1000, 37), (24, 3136, 5), (10, 4100, 9)])
def test_forward_column_blocks_give_the_one_pass_bits(batch, i, o):
    """A batch whose rows of x overflow L1 is summed in column blocks, the partial sums stored
    between blocks (and 4100 columns end in a masked tail); one row alone is summed in one pass.
    Both give every output the same bits, on either instruction set."""
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(batch, i, generator=gen), torch.randn(o, i, generator=gen)
    isas = ["avx2"] + (["avx512"] if _avx512_here() else [])
    try:
        for isa in isas:
            assert kernels.set_isa(isa) == isa
            for bias in (None, torch.randn(o, generator=gen)):
                whole = kernels.linear_forward(x, w, bias)
                rows = torch.cat(
                    [kernels.linear_forward(x[r : r + 1], w, bias) for r in range(batch)]
                )
                assert torch.equal(whole, rows), (isa, bias is None)
    finally:
        kernels.set_isa("avx512")


def test_isa_choice():
    with pytest.raises(ValueError, match="avx2 or avx512"):
        kernels.set_isa("sse")
    if kernels.load() is None:
        pytest.skip("native kernel not built here")
    try:
        assert kernels.set_isa("avx2") == "avx2" == kernels.isa()
        assert kernels.status() == "native (avx2)"
    finally:
        kernels.set_isa("avx512")
    assert kernels.isa() == ("avx512" if _avx512_here() else "avx2")


@native
@pytest.mark.parametrize(("batch", "i", "o"), [(1, 1, 1), (3, 7, 5), (13, 9, 17), (64, 1024, 33)])
def test_odd_widths_and_leading_dims(batch, i, o):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, batch, i, generator=gen)[:, :, :]  # [2, batch, in]: a leading dim
    w, b = torch.randn(o, i, generator=gen), torch.randn(o, generator=gen)
    dy = torch.randn(2, batch, o, generator=gen)
    x2, dy2 = x.reshape(-1, i), dy.reshape(-1, o)
    if 2 * batch > kernels.MAX_BATCH:
        x, dy = x2[:batch], dy2[:batch]
        x2, dy2 = x, dy
    y64, dx64, w64, b64 = reference(x2, w, b, dy2, 0.05)
    close(kernels.linear_forward(x, w, b).reshape(-1, o), y64, i)
    dx = kernels.linear_backward_sgd(dy, x, w, b, 0.05, True)
    assert dx.shape == x.shape
    close(dx.reshape(-1, i), dx64, o)
    close(w, w64, x2.shape[0])
    close(b, b64, x2.shape[0])


@native
def test_same_inputs_same_bits_whatever_the_thread_count():
    gen = torch.Generator().manual_seed(2)
    x, dy = torch.randn(10, 4608, generator=gen), torch.randn(10, 1024, generator=gen)
    w0, b0 = torch.randn(1024, 4608, generator=gen) * 0.01, torch.randn(1024, generator=gen)
    outs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 1, 2):
            torch.set_num_threads(threads)
            w, b = w0.clone(), b0.clone()
            y = kernels.linear_forward(x, w, b)
            dx = kernels.linear_backward_sgd(dy, x, w, b, 0.01, True)
            outs.append((y, dx, w, b))
    finally:
        torch.set_num_threads(before)
    for other in outs[1:]:
        assert all(torch.equal(a, c) for a, c in zip(outs[0], other))


def _train(native_on: bool, batch: int = 10) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(37, 300), nn.ReLU(), nn.Linear(300, 10))
    data = torch.randn(60, 37, generator=torch.Generator().manual_seed(3))
    target = torch.arange(60) % 10
    before = kernels.MAX_BATCH
    kernels.MAX_BATCH = before if native_on else 0  # 0: no batch takes the kernel
    try:
        train_epochs(
            list(model.parameters()),
            lambda x, y: F.cross_entropy(model(x), y),
            lambda pos: (data[pos], target[pos]),
            60,
            2,
            TrainSettings(batch_size=batch, lr=0.1),
            torch.Generator().manual_seed(4),
            modules=(model,),
        )
    finally:
        kernels.MAX_BATCH = before
    return [p.detach().clone() for p in model.parameters()]


@native
def test_training_with_the_kernel_matches_the_torch_path():
    fast, plain = _train(True), _train(False)
    for a, c in zip(fast, plain):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, c) for a, c in zip(fast, plain))  # the kernel really ran
    assert all(torch.equal(a, c) for a, c in zip(fast, _train(True)))  # run to run


@native
@pytest.mark.parametrize("native_on", [True, False])
def test_autograd_still_refuses_a_weight_saved_elsewhere(native_on: bool):
    """The kernel writes W through a pointer; it bumps the version as an in-place op would."""
    layer = nn.Linear(8, 4)
    fused = FusedSGDLinears([layer], 0.1)
    before = kernels.MAX_BATCH
    kernels.MAX_BATCH = before if native_on else 0
    fused.start()
    try:
        h = torch.randn(3, 8) * (layer.weight**2).sum()  # pow saves W; its backward runs last
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            layer(h).sum().backward()
    finally:
        fused.stop()
        kernels.MAX_BATCH = before


def test_fallback_when_switched_off(monkeypatch, caplog):
    monkeypatch.setenv(kernels.ENV, "0")
    kernels.reset()
    try:
        with caplog.at_level("INFO", logger="fedmosaic.kernels"):
            assert kernels.load() is None
            assert kernels.load() is None
        assert not kernels.usable(torch.randn(2, 3), torch.randn(4, 3))
        lines = [r.getMessage() for r in caplog.records if r.name == "fedmosaic.kernels"]
        assert lines == [f"fused SGD layers: torch path ({kernels.ENV}=0)"]  # one line
    finally:
        monkeypatch.delenv(kernels.ENV)
        kernels.reset()


def test_no_compiler_means_the_torch_path(monkeypatch):
    monkeypatch.setattr(kernels, "built", lambda: None)
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    kernels.reset()
    try:
        assert kernels.load() is None
        assert kernels.status() == "torch (cannot build fedmosaic_linear: no g++ on PATH)"
    finally:
        kernels.reset()


# ---- single-input-channel convolutions (kernels.conv) ----------------------------------------
@pytest.mark.parametrize(
    ("stride", "padding", "layout"),
    [(1, 0, "channels_last"), (1, 0, "nchw"), (2, 1, "channels_last"), (2, 2, "nchw")],
)
def test_im2col_conv_step_matches_conv2d_and_sgd(stride, padding, layout):
    gen = torch.Generator().manual_seed(5)
    conv = nn.Conv2d(1, 6, 5, stride=stride, padding=padding)
    assert fast_conv.eligible(conv) and not fast_conv.eligible(nn.Conv2d(2, 6, 5))
    x = torch.randn(3, 1, 13, 11, generator=gen, requires_grad=True)
    w0, b0 = conv.weight.detach().clone(), conv.bias.detach().clone()
    want = F.conv2d(x, w0.requires_grad_(), b0.requires_grad_(), stride, padding)
    g = torch.randn(want.shape, generator=gen)
    if layout == "channels_last":
        g = g.contiguous(memory_format=torch.channels_last)
    want.backward(g)
    xk = x.detach().clone().requires_grad_()
    got = fast_conv.SGDConv2d.apply(xk, conv.weight, conv.bias, 0.1, conv)
    assert got.is_contiguous(memory_format=torch.channels_last)  # no copy before pooling
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.backward(g)
    torch.testing.assert_close(xk.grad, x.grad, rtol=1e-5, atol=1e-5)  # with the old W
    torch.testing.assert_close(conv.weight.detach(), w0 - 0.1 * w0.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(conv.bias.detach(), b0 - 0.1 * b0.grad, rtol=1e-5, atol=1e-6)
    assert conv.weight.grad is None  # the update went into W, not W.grad


@native
def test_zoo_cnn_trains_as_with_the_optimizer():
    """cnn1 (1-channel conv, 4608x512 Linear) at batch 10: fused fast paths vs torch's SGD."""

    def run(fused: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = build_client_model("cnn1", (1, 28, 28), 10, 64)
        data = torch.randn(40, 1, 28, 28, generator=torch.Generator().manual_seed(6))
        target = torch.arange(40) % 10
        train_epochs(
            list(model.parameters()),
            lambda x, y: F.cross_entropy(model(x), y),
            lambda pos: (data[pos], target[pos]),
            40,
            1,
            TrainSettings(batch_size=10, lr=0.05, accel=AccelSettings(fused_sgd=fused)),
            torch.Generator().manual_seed(7),
            modules=(model,),
        )
        return [p.detach().clone() for p in model.parameters()]

    for a, c in zip(run(True), run(False)):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)


# ---- the gray CNNs' first block, conv -> 2x2 max pool -> ReLU (kernels.conv) -------------------
def _block(o: int, k: int, pad: int) -> nn.Sequential:
    from fedmosaic.models._layers import ToChannelsLast

    return nn.Sequential(
        nn.Conv2d(1, o, k, padding=pad), ToChannelsLast(), nn.MaxPool2d(2), nn.ReLU()
    )


@native
@pytest.mark.parametrize(
    ("o", "k", "pad", "h", "w"),
    [(32, 5, 0, 28, 28), (16, 5, 2, 8, 8), (64, 3, 1, 12, 12), (8, 4, 0, 13, 10), (40, 5, 0, 9, 9)],
)
def test_conv_pool_relu_block_matches_torch_and_sgd(o, k, pad, h, w):
    gen = torch.Generator().manual_seed(8)
    block = _block(o, k, pad)
    assert fast_conv.block_eligible(block)
    x = torch.randn(7, 1, h, w, generator=gen)
    conv = block[0]
    w0, b0 = conv.weight.detach().clone(), conv.bias.detach().clone()
    ref_w, ref_b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    want = F.relu(F.max_pool2d(F.conv2d(x, ref_w, ref_b, padding=pad), 2))
    g = torch.randn(want.shape, generator=gen)
    want.backward(g)
    got = fast_conv.SGDConvPoolReLU.apply(x, conv.weight, conv.bias, 0.1, conv)
    assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.backward(g)
    torch.testing.assert_close(conv.weight.detach(), w0 - 0.1 * ref_w.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv.bias.detach(), b0 - 0.1 * ref_b.grad, rtol=1e-5, atol=1e-5)
    assert conv.weight.grad is None and conv.bias.grad is None  # the update went into W


@native
def test_conv_pool_relu_block_pools_as_torch_does_ties_and_nan():
    """The kept window position is torch's max-pool index: first maximum, and NaN wins."""
    mod = kernels.load()
    k, o = 3, 8
    weight = torch.randn(o, k * k, generator=torch.Generator().manual_seed(9))
    x = torch.randn(2, 10, 10, generator=torch.Generator().manual_seed(10))
    x[0] = 1.0  # every window a four-way tie
    x[1, 4, 4] = float("nan")
    conv = F.conv2d(x.unsqueeze(1), weight.view(o, 1, k, k))  # [2, o, 8, 8]
    _, idx = F.max_pool2d(conv, 2, return_indices=True)  # flat positions in the 8 x 8 grid
    out, arg = mod.conv_pool_relu_forward(x.contiguous(), weight, None, k)
    py = torch.arange(4).view(1, 4, 1, 1)
    px = torch.arange(4).view(1, 1, 4, 1)
    q = arg.long()
    ours = (2 * py + q // 2) * 8 + 2 * px + q % 2  # [2, 4, 4, o]
    assert torch.equal(ours, idx.permute(0, 2, 3, 1))
    assert (arg[0] == 0).all() and out[1].isnan().any()


@native
def test_the_block_is_fused_where_it_fits():
    settings = TrainSettings()
    for member, fused in (("cnn1", True), ("fedavgcnn", True), ("fedhenn_cnn1", False)):
        model = build_client_model(member, (1, 28, 28), 10, 64)
        layers = FusedSGDLinears.eligible(list(model.modules()), list(model.parameters()), settings)
        blocks = [m for m in layers if isinstance(m, nn.Sequential)]
        assert bool(blocks) == fused, member
        assert all(id(b[0]) not in {id(m) for m in layers} for b in blocks)  # conv inside only
    x = torch.randn(2, 1, 28, 28, requires_grad=True)  # an input gradient: the plain layers
    assert not fast_conv.block_fits(x, _block(8, 5, 0)[0])
    assert fast_conv.block_fits(x.detach(), _block(8, 5, 0)[0])


@native
def test_block_inference_is_the_native_op_unless_observed(monkeypatch):
    """Without autograd the zoo's conv block runs the native op (same values as torch's layers);
    a hook on a child (FLOP counting) makes the children run one by one."""
    from fedmosaic.models import _layers

    model = build_client_model("cnn2", (1, 28, 28), 10, 64).eval()
    block = model.encoder.conv1
    assert isinstance(block, _layers.ConvPoolReLU) and fast_conv.block_eligible(block)
    x = torch.randn(30, 1, 28, 28, generator=torch.Generator().manual_seed(11))
    want = block(x).detach()  # grad enabled: torch's layers
    calls = []
    real = fast_conv.conv_pool_relu_inference
    monkeypatch.setattr(
        fast_conv, "conv_pool_relu_inference", lambda *a: calls.append(1) or real(*a)
    )
    with torch.no_grad():
        got = block(x)
        feats = model.features(x)
    assert len(calls) == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(feats, model.features(x).detach(), rtol=1e-4, atol=1e-5)
    seen = []
    handle = block[2].register_forward_hook(lambda m, a, o: seen.append(o.shape))
    try:
        with torch.inference_mode():
            block(x)
    finally:
        handle.remove()
    assert seen == [torch.Size([30, 32, 12, 12])] and len(calls) == 2  # the children ran


@pytest.mark.skipif(not _avx512_here(), reason="no AVX-512 here (or no native kernel)")
@pytest.mark.parametrize(("o", "k", "h"), [(32, 5, 28), (64, 3, 10), (40, 5, 13), (16, 4, 9)])
def test_block_avx512_code_gives_the_avx2_bits(o, k, h):
    mod = kernels.load()
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(6, h, h, generator=gen)
    w0, b0 = torch.randn(o, k * k, generator=gen), torch.randn(o, generator=gen)
    outs = []
    try:
        for isa in ("avx2", "avx512"):
            assert kernels.set_isa(isa) == isa
            w, b = w0.clone(), b0.clone()
            out, arg = mod.conv_pool_relu_forward(x, w, b, k)
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(13))
            mod.conv_pool_relu_backward_sgd(g, out, arg, x, w, b, k, 0.1)
            outs.append((out, arg, w, b))
    finally:
        kernels.set_isa("avx512")
    for a, c in zip(*outs):
        assert torch.equal(a, c)


def test_a_build_killed_mid_compile_does_not_hang_the_next(monkeypatch, tmp_path):
    """torch's build leaves a ``lock`` file when its process is SIGKILLed mid-compile, and every
    later build waited on it forever. Under fedmosaic's own (OS) lock that file is stale and is
    removed; the OS lock itself is held while torch compiles."""
    import fcntl

    from torch.utils import cpp_extension

    (tmp_path / "lock").write_text("")  # the dead build's leftover
    monkeypatch.setattr(kernels, "build_dirs", lambda: [tmp_path])
    monkeypatch.setattr(kernels, "compiler", lambda: None)
    seen: list[str] = []

    def fake_load(name, sources, build_directory, **kw):  # torch's FileBaton, in short
        d = Path(build_directory)
        if (d / "lock").exists():
            raise TimeoutError("waited on a stale lock (torch would wait forever)")
        with open(d / "build.flock", "a") as fh, pytest.raises(BlockingIOError):
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours, held by build()
        (d / f"{name}.so").write_bytes(b"")
        seen.append(name)

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    so = kernels.build()
    assert so == tmp_path / f"{kernels.NAME}.so" and seen == [kernels.NAME]
    assert (tmp_path / "stamp").read_text().strip() == kernels._tag()
    assert kernels.build() == so and seen == [kernels.NAME]  # up to date: not built again
