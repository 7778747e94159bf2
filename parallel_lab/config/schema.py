"""The config schema: every setting's type, default and meaning, in one place.

``conf/config.yaml`` extends ``Config`` (``defaults: [base_config, ...]``); the yaml files of
``conf/<group>/`` hold only what differs from these defaults. Each strategy's options live in its
``Options`` dataclass (``parallel_lab/strategies``), which ``conf/strategy/<name>.yaml`` extends
(``defaults: [/strategy_options/<name>@_here_]``), so ``strategy.<key>=value`` is typed and checked
like every other key.

Every numeric key declares the values it accepts beside its default (``ranged``: a ``Range`` in the
field's metadata); ``config/validate.py check_ranges`` refuses anything else in one line, in the
parent, before anything is written. A strategy's ``Options`` field may declare one as a dict of
``Range``'s arguments under the same metadata key (strategies/ do not import config/).
"""

from __future__ import annotations

import math
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from parallel_lab.choices import Choice, Precision, make_choice

CONFIG_GROUPS = ("strategy", "model", "data", "launcher")  # chosen on the command line: group=name
RANGE = "range"  # the field metadata key holding a numeric key's Range
SEED_END = 2**63  # seeds: torch.Generator.manual_seed takes int64; the data adds 1 (eval set) and the epoch


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: finite, ``low <= v`` (``low < v`` with low_open) and
    ``v < high`` (``v <= high`` with high_closed; ``high_key``: below another key's value). A list
    key: each item, and exactly ``items`` of them when given. null passes (an Optional key's "derive it")."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_closed: bool = False
    high_key: str = ""  # the bound is this key's value (fault.rank < world_size)
    items: Optional[int] = None
    note: str = ""  # what the values mean, printed after the rule
    example: Any = None  # shown in the refusal where the default is null
    integer: bool = False  # a list of integers (a scalar key's type says so itself)

    def holds(self, value: float, high: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value <= high if self.high_closed else value < high
        return math.isfinite(value) and above and below

    def rule(self, integer: bool, high: float, plural: bool = False) -> str:
        """'an integer >= 1', 'a finite number in [0, 1)', 'an integer in [-1, world_size=2)'
        ('integers >= 1' with plural)."""
        kind = (
            ("integers" if plural else "an integer") if integer else ("finite numbers" if plural else "a finite number")
        )
        if self.low == -math.inf and high == math.inf:
            return kind
        shown = f"{self.high_key}={high:g}" if self.high_key else ("2^63" if high == SEED_END else f"{high:g}")
        if high == math.inf:
            return f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        if self.low == -math.inf:
            return f"{kind} {'<=' if self.high_closed else '<'} {shown}"
        return f"{kind} in {'(' if self.low_open else '['}{self.low:g}, {shown}{']' if self.high_closed else ')'}"


def ranged(default: Any = NO_DEFAULT, low: float = -math.inf, high: float = math.inf, **kw: Any) -> Any:
    """A dataclass field with its default and the Range of values it accepts (``factory=`` for a list)."""
    factory = kw.pop("factory", NO_DEFAULT)
    return field(default=default, default_factory=factory, metadata={RANGE: Range(low, high, **kw)})


class Optimizer(Choice):
    """trainer.optimizer: the torch optimizer every strategy builds."""

    adam = "adam"
    adamw = "adamw"
    sgd = "sgd"


class Device(Choice):
    """device: where the ranks compute."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


FaultMode = make_choice("FaultMode", ("raise", "kill"), "fault.mode: how the chosen rank fails.", __name__)


class FaultAt(Choice):
    """fault.at: when in the step the chosen rank fails."""

    step = "step"
    checkpoint = "checkpoint"


Recompute = make_choice(
    "Recompute",
    ("none", "selective", "full"),  # models/recompute.py MODES (models/ cannot import config/)
    "trainer.recompute: which activations the model recomputes in backward instead of keeping.",
    __name__,
)


@dataclass
class TrainerConfig:
    steps: int = ranged(20, 1)
    # Constant across world sizes (as in nanoGPT) so every strategy's numbers compare:
    # each data-parallel rank gets global_batch / dp_world, split again into grad_accum micro-batches.
    global_batch: int = ranged(64, 1)
    grad_accum: int = ranged(1, 1)
    lr: float = ranged(1e-3, 0, low_open=True)
    optimizer: Optimizer = Optimizer.adam  # adam | adamw (decoupled weight decay, DeepSpeed's "Adam") | sgd
    momentum: float = ranged(0.9, 0, 1, note=" (sgd's momentum)")
    weight_decay: float = ranged(0.0, 0)
    betas: list = ranged(factory=lambda: [0.9, 0.999], low=0, high=1, items=2)  # adam/adamw (torch's default)
    eps: float = ranged(1e-8, 0)  # adam/adamw (torch's default)
    # LR schedule: a DeepSpeed schedule name (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
    # LRRangeTest) or a torch.optim.lr_scheduler one, stepped after every optimizer step; null = constant
    lr_scheduler: Optional[str] = None
    lr_scheduler_params: dict = field(default_factory=dict)  # its keyword arguments, as in a ds_config
    # A DeepSpeed JSON config whose optimizer, scheduler, clipping, precision and batch become these
    # trainer settings (and strategy precision) for every strategy (parallel_lab/strategies/zero/ds_file.py)
    recipe: Optional[str] = None
    # fp32 | bf16 for every strategy that has a bf16 mode, set on its own key (single, ddp, manual_ddp, zero*, tp, pp:
    # strategy.precision; fsdp: strategy.mixed_precision); the others refuse bf16 (config/validate.py)
    precision: Precision = Precision.fp32
    # Activation recomputation (models/recompute.py, docs/vit.md): none | selective (each block's
    # attention core: scores, softmax, dropout, weighted sum) | full (each transformer block, only
    # its input kept). Models with blocks only (vit); the same losses and weights as none, bit for bit.
    recompute: Recompute = Recompute.none
    grad_clip: float = ranged(
        0.0, 0, note=" (0 = off)"
    )  # 0 = off, for every strategy (DeepSpeed's own default of 1.0 is overridden)
    seed: int = ranged(0, 0, SEED_END)
    # Steps left out of the timing medians; a DeepSpeed file's "warmup_num_steps": "auto" takes it as
    # HF's Trainer takes its warmup_steps (strategies/zero/ds_auto.py)
    warmup_steps: int = ranged(2, 0)
    # A sweep's timing rounds: every strategy runs this many times, round r in the order rotated to
    # start at strategy r mod n, and each time figure is the median over rounds with its 95%
    # interval (cli/sweep.py, report/timing.py). 1 = one run each, the interval over its steps.
    rounds: int = ranged(1, 1)
    # true: a torch.profiler trace of profile_steps steps right after the warm-up, on every rank, in
    # <run_dir>/traces/rank<k>.json, and where each step's time went in metrics.json's ranks[k].time_ms
    # (docs/profiling.md). false: no profiler, no trace, nothing paid.
    profile: bool = False
    profile_steps: int = ranged(2, 1)  # steps traced when profile=true (>= 1, within steps - warmup_steps)
    threads_per_rank: int = ranged(1, 1)  # intra-op threads per process; one-process strategies get the total
    # Intra-op threads (torch.set_num_threads and OMP_NUM_THREADS) of every process of the run.
    # null = derived: threads_per_rank, times the requested world_size for a one-process strategy
    # (single, dp) so it uses the cores the ranks would have; an explicit n >= 1 is used as is.
    # config.yaml and metrics.json hold the resolved number.
    threads: Optional[int] = ranged(
        None, 1, note=" (or trainer.threads=null to derive it from trainer.threads_per_rank)", example=4
    )
    # true: each process of a CPU run is bound to its own trainer.threads cores (the host's k-th rank
    # to the k-th group of the cores it may use), so the scheduler neither moves a rank nor stacks two
    # on one core. On 2 cores it halved the step-to-step jitter inside a run; each process's own
    # level was unchanged (docs/plan.md, "The noise floor"). Needs ranks
    # per host x threads <= cores. A launcher that already bound each rank narrower (mpirun's
    # --bind-to core) is left as it is; a GPU run is never bound. metrics.json's ranks[k].cores
    # records where each rank ran, bound or not.
    pin_cores: bool = False
    progress: bool = True
    eval_batches: int = ranged(
        2, 0, note=" (0 = skip)"
    )  # batches of held-out data for the accuracy in metrics.json (0 = skip)
    # Checkpoints (parallel_lab/checkpoint/): every N optimizer steps and at the last step.
    checkpoint_every: int = ranged(0, 0, note=" (0 = no checkpoints)")  # 0 = never
    checkpoint_dir: Optional[str] = None  # default <run_dir>/checkpoints
    keep_checkpoints: int = ranged(2, 1)  # newest complete ones kept: a damaged newest falls back to the previous
    resume: str = "auto"  # auto (newest good checkpoint, if any) | never | <path to a step_* folder>
    # true: trainer.resume=<path> may come from any strategy, options and world size; its full state
    # is gathered offline and scattered into this run's layout (checkpoint/full_state.py)
    reshard: bool = False
    # A NEW run (steps count from 0) starting from the weights at this path: one of our checkpoints,
    # a plain DeepSpeed or torch DCP checkpoint, a .safetensors or torch.save state dict
    # (checkpoint/outside.py). Ignored when trainer.resume finds a checkpoint of this run to continue.
    init_from: Optional[str] = None
    init_optimizer: bool = False  # true: also Adam's state (exp_avg, exp_avg_sq, step) from init_from
    # Noise-floor reruns of the `single` baseline only (parallel_lab/report/parity.py; a sweep starts them):
    # move every initial weight one float ulp up or down, signs drawn from this seed. null = off.
    ulp_jitter_seed: Optional[int] = ranged(None, 0, SEED_END, example=1)
    # Noise-floor reruns of `single` only: before every optimizer step, move every gradient element
    # by one float ulp of its tensor's largest gradient, signs drawn from this seed. null = off.
    grad_ulp_seed: Optional[int] = ranged(None, 0, SEED_END, example=1)
    # Set by a sweep on its noise-floor reruns of `single` (the perturbation's label, e.g.
    # "micro_batches=2"; parallel_lab/report/parity.py noise_reruns): marks the run as one. null = a run.
    noise_rerun: Optional[str] = None


class Norm(Choice):
    """``model.norm``: the normalisation layer of the models that have one (docs/batchnorm.md)."""

    group = "group"  # GroupNorm (resnet18; the cnn has no norm layer): per sample, the same under every split
    batch = "batch"  # plain nn.BatchNorm2d, as users write it: statistics over whatever batch a rank sees
    # BatchNorm2d, converted to SyncBatchNorm by a data-parallel strategy: statistics over the global batch
    syncbatch = "syncbatch"


@dataclass
class ModelConfig:
    name: str = MISSING  # cnn | resnet18 | vit | gpt
    num_classes: int = ranged(10, 10, note=" (the data's labels are 0-9)")
    # Multiplier on every channel/feature width (1.0 = the models as they are, bit-identical);
    # parameters grow about width^2: cnn x 180 and resnet18 x 30 reach ~10B (python -m parallel_lab.plan).
    # vit: multiplies model.dim (rounded to a multiple of model.heads).
    width: float = ranged(1.0, 0, 1000, low_open=True, high_closed=True)
    # group (default, today's models bit for bit) | batch | syncbatch: parallel_lab/strategies/batchnorm.py
    # vit: LayerNorm always; only group (the default) is accepted.
    norm: Norm = Norm.group
    # vit only (cnn and resnet18 ignore them); null = the vit's default in parallel_lab/models/vit.py
    # DEFAULTS, which conf/model/vit.yaml writes out. docs/vit.md.
    patch: Optional[int] = ranged(None, 1, example=4)  # side of a square patch, divides 32: 4 -> 64 tokens
    dim: Optional[int] = ranged(None, 1, example=64)  # token width (64), a multiple of heads
    depth: Optional[int] = ranged(None, 1, example=4)  # transformer blocks (4), each a pipeline stage boundary
    heads: Optional[int] = ranged(None, 1, example=4)  # attention heads (4), head width dim (gpt: hidden) / heads
    mlp_ratio: Optional[float] = ranged(None, 0, low_open=True, example=2.0)  # MLP hidden width / dim (2.0)
    # in [0, 1); 0.0 = off. Masks are keyed by the sample (models/dropout.py), so data-parallel rows
    # draw single's masks; later pipeline stages do not (docs/vit.md).
    dropout: Optional[float] = ranged(None, 0, 1, example=0.1)
    # vit | gpt (null = vit): where the MLP has dropout. vit: after GELU and after fc2; gpt: after
    # fc2 only, as GPT-2 and Megatron (the layout Korthikanti et al.'s activation count assumes).
    dropout_placement: Optional[str] = None
    # Mixture of experts on the vit and the gpt (models/moe.py, docs/moe.md); null = the default in
    # parallel_lab/models/moe.py MOE_DEFAULTS. moe_experts=0: dense MLPs (the default).
    moe_experts: Optional[int] = ranged(None, 0, example=4)  # E experts in each MoE block's MLP
    moe_topk: Optional[int] = ranged(None, 1, example=2)  # experts per token (1), <= moe_experts
    moe_every: Optional[int] = ranged(None, 1, example=2)  # every n-th block's MLP is MoE (2: blocks 1, 3, ...)
    # weight of the Switch load-balancing loss E * sum_e f_e P_e, added to the training loss (0.01)
    moe_aux_weight: Optional[float] = ranged(None, 0, example=0.01)
    # copies an expert takes per sample: ceil(cf * topk * tokens / experts); null = dropless (none dropped)
    moe_capacity_factor: Optional[float] = ranged(None, 0, low_open=True, example=1.25)
    # gpt only (docs/gpt.md; models/gpt.py): null = the preset's value, else the tiny default of
    # models/gpt.py DEFAULTS; the parent writes the resolved sizes into config.yaml. model.heads and
    # model.dropout (above) are the gpt's too.
    preset: Optional[str] = None  # a published shape (models/gpt.py PRESETS: gpt3_175b, llama3_405b, ...)
    layers: Optional[int] = ranged(None, 1, example=2)  # transformer blocks (2)
    hidden: Optional[int] = ranged(None, 1, example=64)  # model width (64), a multiple of heads
    kv_heads: Optional[int] = ranged(None, 1, example=4)  # key/value heads, divides heads (null = heads; fewer: GQA)
    ffn: Optional[int] = ranged(None, 1, example=256)  # MLP width (null = 4 x hidden)
    seq: Optional[int] = ranged(None, 1, example=64)  # context length (64): the data's sequence length
    vocab: Optional[int] = ranged(None, 1, example=256)  # vocabulary (256), at least the data's
    tied: Optional[bool] = None  # true (default): the output projection is the token embedding's weight
    positions: Optional[str] = None  # learned (default) | rotary
    mlp: Optional[str] = None  # gelu (default: fc1, GELU, fc2) | swiglu (Llama's gated MLP)
    bias: Optional[bool] = None  # true (default): Linear biases (GPT-2, Megatron); false: none (Llama)


@dataclass
class DataConfig:
    name: str = MISSING  # synthetic | cifar10 | tokens
    # tokens (data/tokens.py, docs/gpt.md): a text file read as bytes (vocabulary 256); null = the
    # seeded synthetic chain of data.size sequences
    path: Optional[str] = None
    seq: Optional[int] = ranged(None, 1, example=64)  # tokens: sequence length; null = model.seq (must equal it)
    vocab: Optional[int] = ranged(None, 2, example=64)  # tokens: the chain's distinct tokens; null = model.vocab
    root: Optional[str] = None  # folder holding cifar-10-python.tar.gz (cifar10 only)
    size: int = ranged(4096, 1)  # synthetic, tokens: number of training samples generated from the seed
    download: bool = False  # cifar10: fetch the tarball if it is missing (needs internet)
    # cifar10: md5 of the official cifar-10-python.tar.gz (the one place it is written); null skips the check
    md5: Optional[str] = "c58f30108f718f92721af3b95e74349a"


@dataclass
class LauncherConfig:
    name: str = MISSING  # spawn | torchrun | deepspeed | mpirun | slurm
    # Rendezvous host. null = 127.0.0.1 on one node, the first host on several (slurm: rank 0's
    # node from the allocation; mpirun on several hosts: rank 0's host address, found over MPI).
    # Never 0.0.0.0 unless written here.
    master_addr: Optional[str] = None
    master_port: int = ranged(0, 0, 65536, note=" (a TCP port; 0 = pick a free one)")
    # Several machines (docs/multinode.md): the hosts, or a file with one per line ("host",
    # "host slots=N" or "host:N"); world_size must equal nodes x nproc_per_node.
    hosts: list = field(default_factory=list)
    hostfile: Optional[str] = None
    nodes: Optional[int] = ranged(
        None, 1, example=2
    )  # null = len(hosts), or 1; slurm without hosts: how many nodes to ask for
    nproc_per_node: Optional[int] = ranged(None, 1, example=2)  # null = the hostfile's slots, else world_size / nodes
    # How the parent reaches another host to start its torchrun agent (and mpiexec's hydra, if it
    # is not ssh). -tt: closing the connection hangs up the remote agent. null = do not start
    # anything, print the exact per-host commands instead.
    remote_shell: Optional[str] = "ssh -o BatchMode=yes -tt"
    ds_runner: str = "pdsh"  # deepspeed on several hosts: its --launcher (pdsh | mpich | openmpi | ...)
    max_restarts: int = ranged(0, 0)  # torchrun only
    # torchrun only, several hosts: run elastically (--nnodes=min_nodes:len(hosts), c10d rendezvous
    # on host 0): when a host dies the others re-form a smaller group and reshard the newest
    # checkpoint to the new world size (docs/multinode.md). null = a fixed set of hosts.
    min_nodes: Optional[int] = ranged(None, 1, example=1)
    extra_args: list = field(default_factory=list)
    grace_s: float = ranged(10.0, 0, low_open=True)  # after one rank fails, how long the others get before being killed
    # spawn on CPU: fork each rank from a process that has already imported torch (~0.1 s instead
    # of ~6 s of CPU per rank; parallel_lab/worker/zygote.py). false = a fresh
    # `python -m parallel_lab.worker` per rank. The other launchers' tools always start fresh ones.
    fork_ranks: bool = True


@dataclass
class FaultConfig:
    """Deliberate failure, for testing what a crash does: rank ``rank`` fails at step ``step``."""

    rank: int = ranged(-1, -1, high_key="world_size", note=" (-1 = never)")
    step: int = ranged(0, 0)
    mode: FaultMode = FaultMode["raise"]  # raise (a Python exception) | kill (SIGKILL itself, like a lost node)
    # step: before step `step` runs; checkpoint: halfway through writing the checkpoint taken after
    # `step` steps (its files written, not yet committed). Only in the first attempt: a torchrun
    # restart (TORCHELASTIC_RESTART_COUNT > 0) runs clean, as after a real lost node.
    at: FaultAt = FaultAt.step


@dataclass
class PlanConfig:
    """``python -m parallel_lab.plan`` only (parallel_lab/plan): what to predict, against what, where."""

    # Memory of one device, e.g. 24GiB, 80GB, 512MiB; null = read from this machine (CUDA device
    # 0's total memory, else MemAvailable from /proc/meminfo).
    device_memory: Optional[str] = None
    # World sizes to table, e.g. [1,2,4,8,16,32,64,128,256,512,1024]; [] = world_size only. With a
    # list, each rank keeps the micro-batch it has at world_size (the global batch grows).
    world_sizes: list = ranged(factory=list, low=1, example=[1, 2, 4], integer=True)
    out: Optional[str] = None  # output folder; null = runs/plan/<date>_<time>
    # Run folders (or sweeps) whose metrics.json are drawn as measured points in the scaling plot.
    measured: list = field(default_factory=list)
    # true: instead of the per-strategy table, rank every candidate configuration (strategy x its
    # main options x micro-batches x recompute, plan/candidates.py) by predicted samples/s among those
    # that fit device_memory, with no run (plan/recommend.py, docs/plan.md); writes recommend.md/.json.
    recommend: bool = False
    # A GPU cluster to plan for instead of this machine (parallel_lab/plan/cluster, docs/cluster.md):
    # plan.hardware=<name> loads conf/hardware/<name>.yaml (a100_40g, a100_80g, h100_sxm, h200, this_machine),
    # each field then overridable, e.g. plan.hardware.inter_node_gbps=800. null = the
    # CPU planner of this machine.
    hardware: Optional[Any] = None
    # GPUs of the cluster plan (plan.hardware): the world the strategy's degrees multiply to (a
    # strategy.replicate or pipeline stages left unset is derived from it). null = world_size.
    gpus: Optional[int] = ranged(None, 1, example=1024)
    # The cluster plan's compute precision: bf16 | fp16 | fp32; null = trainer.precision where the
    # command sets it, else bf16. tp and pp are planned in bf16 or fp16 too (Megatron's mixed
    # precision), whatever the CPU runs support.
    precision: Optional[str] = None
    # The cluster plan's attention kernel: true = a fused one (FlashAttention, torch's SDPA on GPU):
    # the scores never reach HBM, a causal kernel runs half the score products; false = the model's
    # own explicit matmuls and softmax, priced as counted (Megatron's 2021-2022 runs).
    fused_attention: bool = False


@dataclass
class Config:
    strategy: Any = MISSING  # validated against the strategy's own Options dataclass
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    world_size: int = ranged(2, 1, 64, high_closed=True, note=" (a sane ceiling for one machine)")
    device: Device = Device.auto  # auto | cpu | cuda
    dist_timeout_s: int = ranged(120, 1)  # timeout of every process group
    run_dir: Optional[str] = None  # filled in by the parent
    # Filled in by the parent: each "auto" of a DeepSpeed file (strategy.ds_config, trainer.recipe)
    # as resolved from this run's config, {<file key>: {<key path>: {value, from}}} (strategies/zero/ds_auto.py)
    ds_auto: dict = field(default_factory=dict)
    fault: FaultConfig = field(default_factory=FaultConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
