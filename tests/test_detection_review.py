"""From a review with object detection and segmentation training code."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import nanguard


class ListDetector(nn.Module):
    """torchvision's detector convention: a list of CHW images of several sizes and a list
    of target dicts; the box regression target log(w / w_anchor) computed in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, 2, 1)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(
        self, images: list[torch.Tensor], targets: list[dict[str, torch.Tensor]]
    ) -> torch.Tensor:
        batch = torch.zeros(len(images), 3, 64, 64)
        for i, image in enumerate(images):  # padded into a batch
            batch[i, :, : image.shape[1], : image.shape[2]] = image
        out = self.head(torch.relu(self.conv(batch))).mean((2, 3))
        gt = torch.stack([t["boxes"][0] for t in targets])
        width = gt[:, 2] - gt[:, 0]
        return F.smooth_l1_loss(out[:, 2], torch.log(width / 16.0))


def _images() -> list[torch.Tensor]:
    sizes = [(64, 50), (40, 64), (64, 64), (60, 56)]
    return [torch.rand(3, h, w) for h, w in sizes]


def _targets(zero_width: int | None = None) -> list[dict[str, torch.Tensor]]:
    targets = [
        {"boxes": torch.tensor([[4.0, 4.0, 30.0, 30.0]]), "labels": torch.tensor([1])}
        for _ in range(4)
    ]
    if zero_width is not None:
        targets[zero_width]["boxes"][0, 2] = 4.0  # x2 == x1: a degenerate box
    return targets


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_image_in_a_list_is_not_said_to_be_in_a_sample_of_its_channels(mode: str) -> None:
    torch.manual_seed(0)
    model = ListDetector()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    images = _images()
    images[2][1, 10:20, 10:20] = float("nan")  # a corrupt decode: image 2, green channel
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        model(images, _targets()).backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.tensor) == ("input", "args[0][2]")
    assert "It is in sample" not in origin.message  # (its index in the list is the sample)
    assert "100 NaN of 12,288 values" in origin.message


def test_the_inputs_listed_for_a_forward_origin_take_each_argument_in_turn() -> None:
    torch.manual_seed(0)
    model = ListDetector()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        model(_images(), _targets(zero_width=1)).backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "", "aten.log.default")
    # The targets (where the zero width came from) are listed, and what is left out counted.
    assert "args[0][0] in [" in origin.message
    assert "args[1][0]['boxes'] in [" in origin.message
    assert "; 4 more)" in origin.message


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.filterwarnings("ignore::nanguard.NonFiniteWarning")
def test_a_new_nan_batch_after_the_weights_went_nan_is_an_input_origin(mode: str) -> None:
    # on_nonfinite="warn": training goes on with NaN weights; each new corrupt image is still
    # told (as a full step does), not "nothing new was created".
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, 2, 1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="warn") as guard:
        for step in range(4):
            x = torch.randn(4, 3, 64, 64)
            if step >= 1:
                x[2, 1, 5:10, 5:10] = float("nan")
            loss = guard.check_loss(F.mse_loss(model(x), torch.zeros(4, 4)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    origins = [(e.step, e.phase, e.tensor) for e in guard.events if e.is_origin]
    assert origins == [(1, "input", "args[0]"), (2, "input", "args[0]"), (3, "input", "args[0]")]


def test_a_float16_box_loss_dividing_by_a_size_rounded_to_zero_names_the_division() -> None:
    # ultralytics/yolov5#8539: under float16 autocast (2 * sigmoid(t)) ** 2 is exactly 0 for
    # t below about -9: CIoU's atan(w / h) is 0/0. The float16 hint spoke of exp overflow
    # and log(0) only: a box loss has neither.
    import math

    def aspect_term(pred_wh: Tensor, gt_wh: Tensor) -> Tensor:  # CIoU's v, no eps on h
        w1, h1 = pred_wh.unbind(-1)
        w2, h2 = gt_wh.unbind(-1)
        return (4 / math.pi**2) * torch.pow(torch.atan(w2 / h2) - torch.atan(w1 / h1), 2)

    torch.manual_seed(0)
    head = nn.Linear(64, 2)
    with torch.no_grad():
        head.bias.fill_(-10.0)  # tiny anchors' boxes
    opt = torch.optim.SGD(head.parameters(), lr=0.01)
    x, gt = torch.randn(32, 64) * 0.1, torch.rand(32, 2) + 0.5
    with nanguard.watch(head, optimizer=opt, on_nonfinite="log") as guard:
        with torch.autocast("cpu", dtype=torch.float16):
            wh = (head(x).sigmoid() * 2) ** 2 * 1.25
            loss = guard.check_loss(aspect_term(wh, gt.to(wh.dtype)).float().mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert bool((wh == 0).all())
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.kind) == ("loss", "nan")
    assert origin.hint is not None
    assert "meets log(0) or 0/0 (w / h of a box)" in origin.hint


@pytest.mark.parametrize("with_classification", [False, True])
def test_a_box_loss_over_no_positive_anchor_gets_the_empty_selection_hint(
    with_classification: bool,
) -> None:
    # smooth_l1_loss(reg[pos], target[pos]) averages over zero boxes on a batch with no
    # positive anchor: 0/0. The hint offered a std over one sample, or BCE's pos_weight.
    class Detector(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(
                nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, 2, 1)
            )
            self.cls = nn.Conv2d(16, 9, 1)
            self.reg = nn.Conv2d(16, 36, 1)

        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            f = self.backbone(x)
            boxes = self.reg(f).permute(0, 2, 3, 1).reshape(x.shape[0], -1, 4)
            return self.cls(f).flatten(1), boxes

    torch.manual_seed(0)
    model = Detector()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        logits, boxes = model(torch.randn(4, 3, 32, 32))
        labels = torch.zeros_like(logits)  # no positive anchor in this batch
        positive = labels.bool()
        loss = F.smooth_l1_loss(boxes[positive], torch.zeros_like(boxes[positive]))
        if with_classification:
            loss = loss + F.binary_cross_entropy_with_logits(logits, labels)
        guard.check_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.kind) == ("loss", "nan")
    assert origin.hint is not None
    assert "its own operations: a mean over an empty selection" in origin.hint


def _pgd_l2(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Two L2 PGD steps as adversarial-training code writes them, with no eps in the
    gradient's norm (Harry24k/adversarial-attacks-pytorch's fix: ||g|| + 1e-10)."""
    x_adv = x.clone()
    for _ in range(2):
        x_adv.requires_grad_(True)
        (g,) = torch.autograd.grad(F.cross_entropy(model(x_adv), y), x_adv)
        step = g / g.flatten(1).norm(dim=1).view(-1, 1, 1, 1)  # 0/0 at a zero gradient
        x_adv = (x_adv.detach() + 0.1 * step).clamp(0, 1)
    return x_adv


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_batch_an_attack_made_non_finite_in_the_step_is_not_sent_to_the_loader(
    mode: str,
) -> None:
    # A black frame in a bias-free CNN has an input gradient of exactly 0: the attack's
    # second batch holds NaN, the loader's batch (the step's first call) was finite.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 8 * 8, 10, bias=False),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.rand(32, 3, 16, 16), torch.randint(0, 10, (32,))
    x[9] = 0.0
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        model.eval()
        x_adv = _pgd_l2(model, x, y)
        model.train()
        loss = guard.check_loss(F.cross_entropy(model(x_adv), y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.details["forward"]) == ("input", 2)
    assert origin.hint is not None
    assert "an earlier call of the step got a finite one of its shape" in origin.hint
    assert "x + a * g / ||g|| at a zero gradient" in origin.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_micro_batch_under_input_gradient_regularisation_gets_the_data_hint(
    mode: str,
) -> None:
    # Double backprop (a penalty on the input gradient) over two micro-batches: both need
    # their input's gradient, but the loader made the second, not code from the first.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    loader = [(torch.randn(16, 8), torch.randint(0, 3, (16,))) for _ in range(4)]
    loader[3][0][5, 2] = float("nan")  # a corrupt sample, second micro-batch of step 1
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for i in range(0, 4, 2):
            opt.zero_grad()
            for x, y in loader[i : i + 2]:
                x = x.clone().requires_grad_(True)
                loss = F.cross_entropy(model(x), y)
                (gx,) = torch.autograd.grad(loss, x, create_graph=True)
                guard.check_loss((loss + 0.1 * gx.pow(2).sum()) / 2).backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.details["forward"]) == (1, "input", 2)
    assert origin.hint is not None
    assert "look at the data pipeline" in origin.hint
    assert "built this batch" not in origin.hint
