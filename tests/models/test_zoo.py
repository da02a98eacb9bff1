"""The model zoo: every encoder and family member builds, runs forward/backward, and keeps the
block / projection / head contracts; FLOPs and parameter counts match hand and paper numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fedmosaic.models._layers as layers
from fedmosaic.core.model import ClientModel
from fedmosaic.core.registry import ENCODERS, FAMILIES
from fedmosaic.models import (
    build_client_model,
    build_encoder,
    build_head,
    count_params,
    ends_nonnegative,
    family_members,
    flops_per_image,
    split_member,
    trainable_flops,
)

SHAPES = [(1, 28, 28), (3, 32, 32)]
FEATURE_DIM = 512
NUM_CLASSES = 7


def _build(member: str, shape: tuple[int, int, int], **kw: object) -> ClientModel:
    torch.manual_seed(0)
    return build_client_model(member, shape, NUM_CLASSES, FEATURE_DIM, **kw)  # type: ignore[arg-type]


def _natural_dim(arch: str, shape: tuple[int, int, int]) -> int:
    return ENCODERS.get(arch)(shape[0], shape[1])[1]


# The deep ResNets take seconds each: they run in the full suite, not in the quick (unit) loop.
DEEP = {"resnet34", "resnet50", "resnet101", "resnet152"}
ARCHS = [
    pytest.param(a, marks=pytest.mark.integration) if a in DEEP else a for a in ENCODERS.names()
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("arch", ARCHS)
def test_encoder_contract(arch: str, shape: tuple[int, int, int]) -> None:
    model = _build(arch, shape)
    x = torch.randn(2, *shape)

    # train mode (BatchNorm batch statistics): shapes and gradients everywhere
    model.train()
    feats = model.features(x)
    assert feats.shape == (2, FEATURE_DIM)
    logits = model.head(feats)
    assert logits.shape == (2, NUM_CLASSES)
    logits.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())

    # blocks: non-empty, each owns parameters (bar a pool projection), proj iff dims differ
    blocks = list(model.encoder.named_children())
    assert blocks
    assert all(n.startswith("encoder.") for n, _ in model.blocks())
    names = [n for n, _ in blocks]
    assert ("proj" in names) == (_natural_dim(arch, shape) != FEATURE_DIM)
    assert names[-1] == "proj" or "proj" not in names
    assert all(any(True for _ in b.parameters()) for _, b in blocks)  # linear proj included

    # applying the blocks in order is the forward (eval mode: deterministic BatchNorm)
    model.eval()
    with torch.no_grad():
        out = x[:1]
        for _, block in blocks:
            out = block(out)
        torch.testing.assert_close(out, model.features(x[:1]))


def _all_members() -> list[str]:
    return sorted({m for fam in FAMILIES.names() for m in FAMILIES.get(fam)})


@pytest.mark.parametrize("member", _all_members())
def test_family_member(member: str) -> None:
    """Every member parses to a registered encoder and a head that ends in a Linear (no activation
    on the logits). Encoders are exercised above; full ClientModels with non-default heads below."""
    arch, head_spec = split_member(member)
    assert arch in ENCODERS
    head = build_head(head_spec, FEATURE_DIM, NUM_CLASSES)
    feats = torch.randn(2, FEATURE_DIM, requires_grad=True)
    logits = head(feats)
    assert logits.shape == (2, NUM_CLASSES)
    logits.sum().backward()
    assert feats.grad is not None
    assert isinstance(head[-1] if isinstance(head, nn.Sequential) else head, nn.Linear)


@pytest.mark.parametrize("member", ["fedavgcnn/mlp512", "resnet4/mlp256-128", "cnn1/linear"])
def test_client_model_with_head(member: str) -> None:
    model = _build(member, (3, 32, 32))
    assert model.arch == member
    assert (model.feature_dim, model.num_classes) == (FEATURE_DIM, NUM_CLASSES)
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, NUM_CLASSES)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_family_tables() -> None:
    assert family_members("htfe8-gray") == [f"cnn{i}" for i in range(1, 9)]
    assert family_members("htfe2") == ["fedavgcnn", "resnet18"]
    assert family_members("htfe3") == ["resnet10", "resnet18", "resnet34"]
    assert family_members("htfe4") == ["fedavgcnn", "googlenet", "mobilenetv2", "resnet18"]
    assert len(family_members("htfe8")) == 8 and len(family_members("htfe9")) == 9
    assert family_members("fedclassavg4") == ["resnet18", "shufflenetv2", "googlenet", "alexnet"]
    assert family_members("fedgh5") == [f"fedgh_cnn{i}" for i in range(1, 6)]
    assert family_members("fedhenn5") == [f"fedhenn_cnn{i}" for i in range(1, 6)]
    htfe8_htc4 = family_members("htfe8-htc4")
    assert [split_member(m)[0] for m in htfe8_htc4] == family_members("htfe8")
    for i in range(16):  # client i: encoder i % 8 and head i % 4
        assert split_member(htfe8_htc4[i % 8])[1] == split_member(family_members("htc4")[i % 4])[1]


def test_family_members_lookup() -> None:
    members = family_members("htfe8-gray")
    members.append("oops")  # a copy: the registry is untouched
    assert len(family_members("htfe8-gray")) == 8
    assert family_members("resnet18") == ["resnet18"]
    assert family_members("fedavgcnn/mlp512") == ["fedavgcnn/mlp512"]
    with pytest.raises(KeyError) as err:
        family_members("resnet9000")
    assert "htfe8-gray" in str(err.value) and "fedavgcnn" in str(err.value)
    with pytest.raises(KeyError):
        family_members("fedavgcnn/mlpX")


def test_htc4_heads() -> None:
    """FedTGP HtC4: 100-d fc | 512-d fc, 100-d fc | 256-d, 100-d | 128-d, 100-d; ReLU only between."""
    expected = [[], [512], [256], [128]]
    for member, hidden in zip(family_members("htc4"), expected):
        assert split_member(member)[0] == "resnet34"
        head = build_head(split_member(member)[1], FEATURE_DIM, 100)
        mods = list(head) if isinstance(head, nn.Sequential) else [head]
        linears = [m for m in mods if isinstance(m, nn.Linear)]
        assert [m.out_features for m in linears] == [*hidden, 100]
        assert linears[0].in_features == FEATURE_DIM
        assert isinstance(mods[-1], nn.Linear)
        assert sum(isinstance(m, nn.ReLU) for m in mods) == len(hidden)


def test_head_spec_errors() -> None:
    with pytest.raises(ValueError):
        build_client_model("fedavgcnn/relu", (1, 28, 28), 10, 512)
    with pytest.raises(ValueError):
        build_client_model("fedavgcnn/", (1, 28, 28), 10, 512)
    with pytest.raises(ValueError):
        build_client_model("fedavgcnn", (1, 28, 28), 10, 512, projection="conv")
    with pytest.raises(KeyError):
        build_client_model("nope", (1, 28, 28), 10, 512)


def test_projections() -> None:
    lin = build_client_model("resnet4", (3, 32, 32), 10, 512)  # natural_dim 64
    assert isinstance(lin.encoder.proj, nn.Linear)
    assert (lin.encoder.proj.in_features, lin.encoder.proj.out_features) == (64, 512)
    pool = build_client_model("shufflenetv2", (3, 32, 32), 10, 512, projection="pool")  # 1024
    assert isinstance(pool.encoder.proj, nn.AdaptiveAvgPool1d)
    assert not list(pool.encoder.proj.parameters())
    assert pool.features(torch.randn(2, 3, 32, 32)).shape == (2, 512)
    same = build_client_model("fedavgcnn", (1, 28, 28), 10, 512)
    assert not hasattr(same.encoder, "proj")
    # the pool projection is an average of adjacent channels
    proj = nn.AdaptiveAvgPool1d(2)
    torch.testing.assert_close(
        proj(torch.tensor([[1.0, 3.0, 5.0, 7.0]])), torch.tensor([[2.0, 6.0]])
    )


def test_deterministic_given_seed() -> None:
    for arch in ("cnn3", "resnet8", "shufflenetv2"):
        a, b = _build(arch, (3, 32, 32)), _build(arch, (3, 32, 32))
        for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
            assert ka == kb and torch.equal(va, vb)


@pytest.mark.parametrize("arch", ["fedavgcnn", "cnn1", "cnn8", "fedhenn_cnn5", "resnet10"])
def test_tiny_8x8_images(arch: str) -> None:
    """8x8 digits: unpadded stacks fall back to 'same' padding; ResNets pool globally."""
    model = _build(arch, (1, 8, 8)).eval()
    assert model(torch.randn(3, 1, 8, 8)).shape == (3, NUM_CLASSES)


def test_channels_last_pool_same_numbers_and_vmap() -> None:
    x = torch.randn(4, 3, 32, 32)
    for arch in ("fedavgcnn", "alexnet", "googlenet", "mobilenetv2"):
        model = _build(arch, (3, 32, 32)).eval()
        with torch.no_grad():
            fast = model(x)
            layers.CHANNELS_LAST_POOL = False
            try:
                plain = model(x)
            finally:
                layers.CHANNELS_LAST_POOL = True
        scale = plain.abs().max().item()
        torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-5 * scale)
    # torch.func (used by the simulator's fast path) cannot query channels-last layouts: no-op there
    model = _build("fedavgcnn", (3, 32, 32))
    params = dict(model.named_parameters())
    per_sample = torch.func.vmap(
        lambda xi: torch.func.functional_call(model, params, (xi[None],))[0]
    )(x)
    torch.testing.assert_close(per_sample, model(x), rtol=1e-5, atol=1e-5)


def test_pool_before_relu_is_the_same_function() -> None:
    """The plain CNNs pool before the ReLU (cheaper); values and input gradients are unchanged."""
    x = torch.randn(3, 4, 10, 10)
    x[0, 0, :2, :2] = -1.0  # a window with no positive entry
    grads = []
    outs = []
    for order in ("relu_pool", "pool_relu"):
        xi = x.clone().requires_grad_(True)
        if order == "relu_pool":
            out = nn.functional.max_pool2d(nn.functional.relu(xi), 2)
        else:
            out = nn.functional.relu(nn.functional.max_pool2d(xi, 2))
        out.backward(torch.randn_like(out, generator=torch.Generator().manual_seed(1)))
        outs.append(out.detach())
        grads.append(xi.grad)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_flops_fedavgcnn_by_hand() -> None:
    """fedavgcnn on 1x28x28, feature_dim 512, 10 classes, counted layer by layer."""
    model = build_client_model("fedavgcnn", (1, 28, 28), 10, 512)
    conv1 = 32 * 24 * 24 * (2 * 1 * 25 + 1)  # conv 5x5, 1 -> 32, 24x24 out, bias
    pool1 = 32 * 12 * 12 * 4  # 2x2 max pool: 4 per output
    relu1 = 32 * 12 * 12
    conv2 = 64 * 8 * 8 * (2 * 32 * 25 + 1)
    pool2 = 64 * 4 * 4 * 4
    relu2 = 64 * 4 * 4
    fc1 = 512 * (2 * 1024 + 1) + 512  # linear + ReLU
    head = 10 * (2 * 512 + 1)
    assert flops_per_image(model, (1, 28, 28)) == (
        conv1 + pool1 + relu1 + conv2 + pool2 + relu2 + fc1 + head
    )
    assert flops_per_image(model.encoder, (1, 28, 28)) == flops_per_image(model, (1, 28, 28)) - head


def test_trainable_flops() -> None:
    model = build_client_model("fedavgcnn", (1, 28, 28), 10, 512)
    fwd = flops_per_image(model, (1, 28, 28))
    for p in model.encoder.parameters():
        p.requires_grad_(False)
    head = 10 * (2 * 512 + 1)
    assert trainable_flops(model, (1, 28, 28)) == fwd + head  # + head weight gradient only
    for p in model.parameters():
        p.requires_grad_(True)
    conv1 = 32 * 24 * 24 * (2 * 1 * 25 + 1)
    conv2 = 64 * 8 * 8 * (2 * 32 * 25 + 1)
    fc1 = 512 * (2 * 1024 + 1)
    weight_grads = conv1 + conv2 + fc1 + head  # layers with parameters
    input_grads = fwd - conv1  # every layer after the first trainable one
    assert trainable_flops(model, (1, 28, 28)) == fwd + weight_grads + input_grads
    assert all(p.requires_grad for p in model.parameters())
    assert model.training  # counting runs in eval mode and restores the mode


def test_paper_parameter_counts() -> None:
    # layer_expansion Table 3: the shallow CNN has 582,026 parameters (MNIST, 10 classes)
    assert count_params(build_client_model("shallowcnn", (1, 28, 28), 10, 512)) == 582_026
    # FedGH Table 2 model sizes (CIFAR-10, float32, MiB): CNN-1 10.00, CNN-2 6.92, CNN-3 5.04
    for arch, mib in (("fedgh_cnn1", 10.00), ("fedgh_cnn2", 6.92), ("fedgh_cnn3", 5.04)):
        model = build_client_model(arch, (3, 32, 32), 10, 500)
        assert not hasattr(model.encoder, "proj")
        assert round(count_params(model) * 4 / 2**20, 2) == mib
    # FedTGP Table 9 CNN1 on FMNIST: conv 32*25+32, fc 4608*512+512, classifier 512*10+10
    assert count_params(build_client_model("cnn1", (1, 28, 28), 10, 512)) == 2_365_770
    assert count_params(build_client_model("cnn1", (1, 28, 28), 10, 512), trainable_only=True)


# ---- features that are >= 0 by structure (the guard's Rows(features=True) check) ----------------


@pytest.mark.parametrize("arch", ENCODERS.names())
@pytest.mark.parametrize("projection", ["linear", "pool", "none"])
def test_an_encoder_said_to_end_nonnegative_never_gives_a_negative_feature(arch, projection):
    """Soundness over the registry: where ``ends_nonnegative`` says yes, no input (large, signed)
    in train or eval mode gives a negative feature; it may say no for a block whose forward its
    structure does not show (a ResNet's residual sum), never yes wrongly."""
    torch.manual_seed(0)
    encoder = build_encoder(arch, (1, 28, 28), 48, projection)
    if not ends_nonnegative(encoder):
        return
    for train in (True, False):
        encoder.train(train)
        with torch.no_grad():
            f = encoder(torch.randn(6, 1, 28, 28) * 5 - 1)
        assert float(f.min()) >= 0.0


def test_which_encoders_end_nonnegative():
    # HtFLlib's CNNs end in Linear -> ReLU: natural width or the pool projection keep it
    assert ends_nonnegative(build_encoder("cnn1", (1, 28, 28), 512, "linear"))  # natural 512
    assert ends_nonnegative(build_encoder("cnn1", (1, 28, 28), 64, "pool"))
    assert not ends_nonnegative(build_encoder("cnn1", (1, 28, 28), 64, "linear"))  # proj Linear
    assert not ends_nonnegative(build_encoder("resnet8", (1, 28, 28), 64, "pool"))  # custom block
    assert ends_nonnegative(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Dropout(), nn.Flatten()))
    assert not ends_nonnegative(nn.Sequential(nn.ReLU(), nn.Linear(2, 2)))
    assert not ends_nonnegative(nn.Sequential(nn.ReLU(), nn.BatchNorm1d(2)))
