import torch

from elastic_mnist.model import ConvNet, build_model, state_digest


def test_the_classic_convnet():
    model = ConvNet()
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    assert model.fc.in_features == 1568
    assert [m.out_channels for m in model.modules() if isinstance(m, torch.nn.Conv2d)] == [16, 32]
    assert sum(p.numel() for p in model.parameters()) == 28_986


def test_initialisation_depends_on_the_seed_only():
    torch.manual_seed(123)
    a = state_digest(build_model(7).state_dict())
    torch.manual_seed(456)
    assert state_digest(build_model(7).state_dict()) == a
    assert state_digest(build_model(8).state_dict()) != a


def test_digest_sees_a_single_bit():
    state = build_model(0).state_dict()
    before = state_digest(state)
    weight = state["fc.weight"]
    weight.view(torch.int32)[0, 0] ^= 1
    assert state_digest(state) != before
