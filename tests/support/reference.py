"""An independent single-process reference, written with plain torch and nothing of the
toolkit's training code: the model class and the synthetic data generator are shared (they are
single-device code by design), the batch order and training loop are re-implemented here.

Parity is judged the way the report judges it (parallel_lab/report/parity.py): the reference is also
rerun with every initial weight moved one ulp (one rerun per noise seed), and a run passes when
its divergence from the reference stays within the stated multiple of that measured envelope.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from parallel_lab.data.synthetic import make_synthetic
from parallel_lab.data.tokens import markov_tokens
from parallel_lab.models.cnn import SmallCNN
from parallel_lab.models.gpt import GPT
from parallel_lab.models.resnet import ResNet18
from parallel_lab.models.vit import ViT
from parallel_lab.protocol import load_final_params
from parallel_lab.report.parity import (
    Replicas,
    Verdict,
    adam_lr_of,
    judge_runs,
    log_verdict,
    noise_reruns,
)
from parallel_lab.worker.noise import jitter_gradients, jitter_one_ulp

# vit_dropout: model=vit model.dropout=0.1 (per-sample masks: every split draws single's, models/dropout.py)
# vit_moe: model=vit model.patch=8 model.depth=2 model.moe_experts=4 model.moe_topk=2 (tests/integration/test_ep.py)
VIT_MOE = {"patch": 8, "depth": 2, "moe_experts": 4, "moe_topk": 2}
MODELS = {
    "cnn": SmallCNN,
    "resnet18": ResNet18,
    "vit": ViT,
    "vit_dropout": functools.partial(ViT, dropout=0.1),
    "vit_moe": functools.partial(ViT, **VIT_MOE),
}
# model=gpt at the tests' tiny size (GPT_RUN's overrides), on data=tokens' synthetic chain
GPT_SIZES = {"layers": 2, "hidden": 32, "heads": 4, "seq": 32, "vocab": 64}
GPT_RUN = ("model=gpt", "data=tokens", *(f"model.{k}={v}" for k, v in GPT_SIZES.items()))
MODELS.update(
    gpt=functools.partial(GPT, **GPT_SIZES),
    gpt_dropout=functools.partial(GPT, dropout=0.1, **GPT_SIZES),
    gpt_untied=functools.partial(GPT, tied=False, **GPT_SIZES),  # model.tied=false: what pp trains
)
# model=gpt with MoE MLPs (GPT_MOE's model.* keys; tests/support/bodies/cp_gpt.py): block 1 of 2
GPT_MOE = {"moe_experts": 4, "moe_topk": 2}
MODELS["gpt_moe"] = functools.partial(GPT, **GPT_MOE, **GPT_SIZES)
# The gpt's other layouts (tests/support/bodies/tp_gpt.py): name -> its model.* overrides.
GPT_VARIANTS = {
    "gpt_llama": {"tied": False, "kv_heads": 2, "mlp": "swiglu", "positions": "rotary", "bias": False},
    "gpt_untied_nobias": {"tied": False, "bias": False},
    "gpt_llama_dropout": {"tied": False, "kv_heads": 2, "mlp": "swiglu", "positions": "rotary", "dropout": 0.1},
}
MODELS.update({name: functools.partial(GPT, **sizes, **GPT_SIZES) for name, sizes in GPT_VARIANTS.items()})


def reference_data(model: str, size: int, seed: int):
    """What the run's data is: data=tokens' chain for a gpt, data=synthetic's images otherwise."""
    if model.startswith("gpt"):
        return markov_tokens(size, GPT_SIZES["seq"], GPT_SIZES["vocab"], seed, table_seed=seed)
    return make_synthetic(size, seed)


def global_batches(size: int, global_batch: int, seed: int):
    """What every strategy must see: epoch e's permutation is randperm(seed + e), cut in order."""
    epoch = 0
    while True:
        order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, size - global_batch + 1, global_batch):
            yield order[start : start + global_batch]
        epoch += 1


def _leaves_threads_as_found(fn):
    """``fn`` with torch's intra-op thread count set back afterwards to what it was. The reference is
    computed inside ranks too (rank 0 only, in the test bodies): a noise rerun's other count left
    behind made that rank train the next configuration with 2 threads against its peers' 1, and
    MKL's matrix products split their sums by thread, so tp ranks computing the same replicated
    layers on the same inputs disagreed in the last bits (test_tp_vit's manual-dropout)."""

    @functools.wraps(fn)
    def restoring(*args, **kwargs):
        previous = torch.get_num_threads()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(previous)

    return restoring


@_leaves_threads_as_found
def reference_run(
    model: str = "cnn",
    steps: int = 4,
    global_batch: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    optimizer: str = "adam",
    data_size: int = 4096,
    threads: int = 2,
    grad_clip: float = 0.0,
    ulp_jitter_seed: int | None = None,
    grad_ulp_seed: int | None = None,
    grad_accum: int = 1,
    precision: str = "fp32",
    norm: str = "group",
):
    """Plain training loop: returns (per-step losses, final parameter checksum, final model).
    grad_clip > 0 clips the whole model's gradient norm; ulp_jitter_seed moves every initial weight
    one ulp, grad_ulp_seed moves every gradient by its rounding noise (jitter_gradients) and
    grad_accum > 1 sums the batch's gradient over that many equal micro-batches (noise-floor
    reruns). precision="bf16": the textbook mixed-precision loop (arXiv
    1710.03740, bf16 needing no loss scaling): each step a bf16 copy of the fp32 model runs forward
    and backward on bf16 inputs, the loss in fp32, and its gradients, cast to fp32, are the fp32
    master weights' gradients for the optimizer. norm: model.norm (batch: BatchNorm over the
    whole batch, the one-process training every syncbatch row must match)."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    net = _build(model, norm)
    if ulp_jitter_seed is not None:
        jitter_one_ulp(net, ulp_jitter_seed)
    data = reference_data(model, data_size, seed)
    if optimizer == "adam":
        opt = torch.optim.Adam(net.parameters(), lr=lr, foreach=False)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    losses, batches = [], global_batches(data_size, global_batch, seed)
    grad_noise = None if grad_ulp_seed is None else torch.Generator().manual_seed(grad_ulp_seed)
    for _ in range(steps):
        idx = next(batches)
        x, y = data.tensors[0][idx], data.tensors[1][idx]
        opt.zero_grad()
        loss = sum(
            _backward(net, xs, ys, precision, grad_accum) for xs, ys in zip(x.chunk(grad_accum), y.chunk(grad_accum))
        )
        if grad_noise is not None:
            jitter_gradients(net.parameters(), grad_noise)
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), grad_clip)
        opt.step()
        losses.append(loss.item())
    checksum = float(sum(p.detach().double().sum().item() for p in net.parameters()))
    return losses, checksum, net


def _build(model: str, norm: str) -> torch.nn.Module:
    return MODELS[model]() if norm == "group" else MODELS[model](norm=norm)


def _backward(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str, parts: int) -> torch.Tensor:
    """Adds the gradient of this micro-batch's mean loss / parts (one of parts equal micro-batches
    of the batch) to net's .grad; returns that share of the batch's loss."""
    if precision == "bf16":
        return _bf16_backward(net, x, y, parts)
    loss = torch.nn.functional.cross_entropy(net(x), y)
    aux = getattr(net, "aux", None)  # an MoE model's load-balancing losses of this forward: part of the loss
    if aux is not None and aux.total() is not None:
        loss = loss + aux.total()
    share = loss / parts if parts > 1 else loss
    share.backward()
    return share.detach()


def _bf16_backward(master: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, parts: int) -> torch.Tensor:
    """Forward/backward on a bf16 copy of master; the copy's gradients, in fp32, are added to master's."""
    work = copy.deepcopy(master).to(torch.bfloat16)
    inputs = x.to(torch.bfloat16) if x.is_floating_point() else x  # a gpt's token ids stay int64
    loss = torch.nn.functional.cross_entropy(work(inputs).float(), y)
    share = loss / parts if parts > 1 else loss
    share.backward()
    for p, w in zip(master.parameters(), work.parameters()):
        p.grad = w.grad.float() if p.grad is None else p.grad + w.grad.float()
    return share.detach()


def _named(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in net.named_parameters()}


@dataclass
class ParityReference:
    """The reference run and its noise-floor reruns; judges a run the way the report does."""

    losses: list[float]
    net: torch.nn.Module
    noise: list[tuple[list[float], dict]] = field(default_factory=list)
    adam_lr: float | None = None  # judge()'s Adam floors: the reference's lr when it trained with Adam

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return _named(self.net)

    def verdict(
        self,
        losses: list[float],
        params: dict | list,
        label: str = "",
        expect_pass: bool = True,
        replicas: Replicas | None = None,
    ) -> Verdict:
        """The report's verdict on (losses, params); logged for the bench with what the test expects
        (expect_pass=False: a deliberately broken variant). replicas: the run's replica check
        (report/parity.py Replicas), where the test has it."""
        if isinstance(params, (list, tuple)):  # a strategy's full_parameters(), in model order
            params = {name: p.detach().cpu() for name, p in zip(self.params, params, strict=True)}
        run, base = (losses, params), (self.losses, self.params)
        verdict = judge_runs(run, base, self.noise, adam_lr=self.adam_lr, replicas=replicas)
        log_verdict(label, verdict, expect_pass)
        return verdict

    def assert_matches(
        self, losses: list[float], params: dict | list, label: str = "", replicas: Replicas | None = None
    ) -> Verdict:
        """verdict() must pass; replicas: the run's replica check (``Replicas.of`` its metrics)."""
        verdict = self.verdict(losses, params, label, replicas=replicas)
        assert verdict.passed, f"{label}: not the same training as the reference: {verdict.reason()}"
        return verdict

    def assert_run_matches(self, metrics: dict, label: str = "") -> Verdict:
        """A CLI run (metrics with its run_dir, as the cli fixture of tests/conftest.py returns them)."""
        params = load_final_params(Path(metrics["run_dir"]))
        assert params is not None, f"{label}: the run wrote no final_params.pt"
        label = label or metrics["strategy"]
        verdict = self.verdict(metrics["losses"], params, label, replicas=Replicas.of(metrics))
        assert verdict.passed, f"{label}: not the same training as the reference: {verdict.reason()}"
        return verdict


# A folder every process of one test session shares (tests/conftest.py sets it: the session's
# temporary root, which both test processes and every rank they start see): a reference computed
# once is read by the others instead of trained again. Unset, each process computes its own.
SHARED_REFERENCES_ENV = "PARALLEL_LAB_TEST_REFERENCES"
# What selects the kernels, hence the reference's bits: a process under another dispatch computes its own.
DISPATCH_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")


@functools.lru_cache(maxsize=None)  # several test files compare with the same reference: compute it once
def parity_reference(model: str = "cnn", optimizer: str = "adam", lr: float = 1e-3, **kwargs) -> ParityReference:
    """reference_run(**kwargs) plus its noise-floor reruns (parallel_lab.report.parity.noise_reruns),
    computed once per test session (SHARED_REFERENCES_ENV) and per process otherwise."""
    kwargs.update(optimizer=optimizer, lr=lr)
    path = _shared_path(model, kwargs)
    if path is not None and path.is_file():
        return _read_reference(path, model, kwargs)
    losses, _, net = reference_run(model, **kwargs)
    defaults = {name: p.default for name, p in inspect.signature(reference_run).parameters.items()}
    batch, threads, norm = (kwargs.get(key, defaults[key]) for key in ("global_batch", "threads", "norm"))
    noise = []
    for changes in noise_reruns(batch, 1, threads, batch_statistics=norm != "group").values():
        noise_losses, _, noise_net = reference_run(model, **{**kwargs, **changes})
        noise.append((noise_losses, _named(noise_net)))
    reference = ParityReference(losses, net, noise, adam_lr_of(optimizer, lr))
    if path is not None:
        _write_reference(path, reference)
    return reference


def _shared_path(model: str, kwargs: dict) -> Path | None:
    folder = os.environ.get(SHARED_REFERENCES_ENV)
    if not folder:
        return None
    key = repr((model, sorted(kwargs.items()), [os.environ.get(k) for k in DISPATCH_ENV], torch.__version__))
    return Path(folder) / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"


def _write_reference(path: Path, reference: ParityReference) -> None:
    """Written whole, then renamed into place: a process reading it never sees a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "losses": reference.losses,
        "state": reference.net.state_dict(),
        "noise": reference.noise,
        "adam_lr": reference.adam_lr,
    }
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(record, partial)
    os.replace(partial, path)


def _read_reference(path: Path, model: str, kwargs: dict) -> ParityReference:
    """The stored reference, its model rebuilt as reference_run builds it and given the stored state."""
    record = torch.load(path, weights_only=True)
    norm = kwargs.get("norm", "group")
    with torch.random.fork_rng():  # building draws initial weights: the caller's generator is left as found
        net = _build(model, norm)
    net.load_state_dict(record["state"])
    noise = [(losses, params) for losses, params in record["noise"]]
    return ParityReference(record["losses"], net, noise, record["adam_lr"])


def vit_reference(cfg, data_size: int) -> ParityReference:
    """The single-process reference of a vit run's config (test bodies at world > 1): one thread,
    dropout 0.1 or off as the run has it, its gradient clip where it sets one and the bf16 loop
    where it trains in bf16 (the cache key of a run without them stays that of every other caller)."""
    clip = {"grad_clip": cfg.trainer.grad_clip} if cfg.trainer.grad_clip else {}
    bf16 = {"precision": "bf16"} if cfg.trainer.get("precision") == "bf16" else {}  # the bf16 loop and floor
    return parity_reference(
        "vit_dropout" if cfg.model.dropout else "vit",
        steps=cfg.trainer.steps,
        global_batch=cfg.trainer.global_batch,
        threads=1,
        data_size=data_size,
        **clip,
        **bf16,
    )
