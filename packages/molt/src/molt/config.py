"""The typed configuration of a molt run: one frozen msgspec Struct per flag group.

Every field has a default and, right under it, a one-line docstring that `molt train --help` prints and
`config.toml` carries as a comment (`molt._bounds.leaves` reads them from this file's source). A field's
dotted path is its flag: `Config.algo.kl.coef` is `--algo.kl.coef`. Precedence is defaults <
`--config FILE.toml` < flags (`molt._flags.resolve`).

A numeric field declares its bound on its type (`Annotated[float, Meta(gt=0)]`), which `--help` shows;
what may be set to what, and which combinations run here, is checked in one place: `molt._validate`.
This module imports nothing heavy: it is loaded by `molt --help`. The algorithm's groups (`--algo.*`)
live in `molt._config_algo`; they are re-exported here.
"""

import datetime
from pathlib import Path
from typing import Annotated, Literal, get_args

import msgspec
from msgspec import Meta

from molt._config_algo import (
    GAE,
    KL,
    Advantage,
    Algo,
    Correction,
    CorrectionMode,
    Critic,
    EstimatorName,
    KLKind,
    Loss,
    OutcomeEstimator,
    PolicyLossKind,
    Teacher,
)
from molt._config_algo import Group as _Group

__all__ = [
    "GAE",
    "KL",
    "Advantage",
    "Algo",
    "Config",
    "ConfigError",
    "Correction",
    "CorrectionMode",
    "Critic",
    "EstimatorName",
    "KLKind",
    "LoRATarget",
    "Loss",
    "OutcomeEstimator",
    "PolicyLossKind",
    "Teacher",
    "with_run_dir",
]


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the flags involved and what to do."""


class Model(_Group):
    """The policy model."""

    path: str = ""
    """Hugging Face model directory; empty = the seeded tiny model, built into the run directory."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the trained policy."""


class Data(_Group):
    """The prompt dataset."""

    path: str = ""
    """JSONL file, one row of chat messages plus task fields per line; empty = the agent's generated rows."""
    apply_chat_template: bool = True
    """true: rows hold chat messages (and optional tools), rendered once at generation (Env: by molt,
    ChatAgent: by tito, the same renderer); false: rows hold text already rendered (Env agents only)."""
    messages_key: str = "messages"
    """Key of the chat-message list in each row of --data.path and --eval.path (JSONL files)."""
    seed: Annotated[int, Meta(ge=0)] = 0
    """Seed of the prompt order."""


class Agent(_Group):
    """The agent: one Python module exporting `AgentRunner` (a molt.Env or molt.ChatAgent subclass)."""

    module: str = "molt.recipes.copy_word"
    """File path or importable module name that exports AgentRunner."""
    timeout: Annotated[float, Meta(gt=0)] = 60.0
    """Seconds one rollout may take; past it the rollout is lost (counted in agent/timed_out) and retried."""
    max_turns: Annotated[int, Meta(ge=1)] = 1
    """Most LLM turns per episode of an Env agent; an episode whose next prompt would not fit in
    --vllm.max_model_len ends there, truncated."""
    num_runners: Annotated[int, Meta(ge=0)] = 1
    """Ray actors hosting the agents (each runs many episodes concurrently); 0 runs them in the trainer's
    process, without a Ray call per reset and step (for cheap agents)."""


LoRATarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""The projections of a dense decoder layer (Qwen, Llama) that LoRA can wrap, by their checkpoint names."""


class LoRA(_Group):
    """LoRA adapters on the policy (NeMo AutoModel's PEFT): only the adapters train; refits send them alone
    to engines serving them (vLLM's LoRA), and `molt export` writes them (or the merged model, --merged)."""

    rank: Annotated[int, Meta(ge=0)] = 0
    """Rank of each adapter; 0 = LoRA off (the whole policy trains)."""
    alpha: Annotated[float, Meta(gt=0)] = 16.0
    """Scale numerator: the adapter's update is alpha / rank * B @ A."""
    target_modules: list[LoRATarget] = msgspec.field(default_factory=lambda: list(get_args(LoRATarget)))
    """Linear layers that get an adapter, by name (comma-separated); the attention and MLP projections."""
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    """Dropout on the adapters; only 0 is accepted: in the loss's forward it would put a randomly thinned
    policy in every ratio, against logprobs that the full policy scored (old logprobs, the engines')."""


class Actor(_Group):
    """The FSDP2 policy actor and its optimizer."""

    lr: Annotated[float, Meta(gt=0)] = 1e-3
    """AdamW learning rate."""
    weight_decay: Annotated[float, Meta(ge=0)] = 0.0
    """AdamW weight decay."""
    grad_clip: Annotated[float, Meta(gt=0)] = 1.0
    """Clip the global gradient norm to this value."""
    micro_batch_tokens: Annotated[int, Meta(ge=0)] = 0
    """Tokens per forward/backward pass (a micro-batch's packed rows, or its padded slots for a model that
    cannot pack); does not change the update. At least --vllm.max_model_len; 0 = sized from the memory
    the actor has free once loaded (`molt._packing.auto_micro_batch_tokens`; 4 GiB of activations on a
    CPU)."""
    pack: bool = True
    """Lay each micro-batch's rows end to end without padding, attention within each row (varlen on CUDA);
    false pads rows to the micro-batch's longest. Models that cannot pack are padded either way."""
    shared_prefix: Literal["auto", "on", "off"] = "auto"
    """Within a packed micro-batch, compute once the tokens that rows begin with alike (a group's prompt, a
    multi-turn episode's earlier turns), each row's continuation attending to that prefix and not to its
    siblings (`molt._prefix`); the results are each row's alone. The group's rows are planned into one
    micro-batch. on needs --actor.pack and a model that packs, and not --train.routing_replay; auto = on
    with CUDA where those hold (on one H200: 3.4x the actor's tokens/s on 4k shared prompts, 2.2x on
    multi-turn episodes), off on a CPU, where its Python layout costs more than a small model saves."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory (then --actor.compile auto is off)."""
    compile: Literal["auto", "on", "off"] = "auto"
    """Compile each decoder layer with torch.compile (CUDA only): its elementwise work (norms, rotary
    embeddings, activations, casts) fuses into fewer kernels. auto = on with CUDA unless activation
    checkpointing or routing replay is on. The graphs are built at start-up, over dummy rows, while the
    engines load and no longer (the layouts not built by then compile in the first step that meets them);
    a later step that still meets a new shape compiles it (`actor/compiles`)."""
    compute_dtype: Literal["model", "float32", "bfloat16"] = "model"
    """dtype of the forward and backward passes and of the weights a refit sends; model = --model.dtype.
    --model.dtype float32 with bfloat16 here keeps float32 master weights and optimizer state (FSDP2 mixed
    precision; gradients are reduced in float32)."""
    freeze_moe_router: bool = False
    """Keep MoE router weights fixed (coarser alternative to --train.routing_replay)."""
    warmup_steps: Annotated[int, Meta(ge=0)] = 0
    """Linear learning-rate warm-up over this many optimizer steps."""
    num_ranks: Annotated[int, Meta(ge=1)] = 1
    """Data-parallel ranks of the actor: processes on CPU, GPUs on GPU."""
    lora: LoRA = LoRA()


class FSDP(_Group):
    """Actor-side parallelism composed with FSDP2 sharding (NeMo AutoModel)."""

    tp_size: Annotated[int, Meta(ge=1)] = 1
    """Tensor parallelism of the actor."""
    ep_size: Annotated[int, Meta(ge=1)] = 1
    """Expert parallelism of the actor; 256 expresses a DeepSeek-V3-class MoE."""
    cp_size: Annotated[int, Meta(ge=1)] = 1
    """Context parallelism of the actor; only 1 runs for now (the actor does not split sequences yet)."""
    offload: bool = False
    """Hold optimizer (Adam) states in host memory (CUDA only)."""


class VLLM(_Group):
    """The rollout engines."""

    num_engines: Annotated[int, Meta(ge=1)] = 1
    """Number of vLLM engines: each on GPUs of its own, or with --vllm.placement shared all on the one GPU,
    splitting the engines' memory share and the sequences in flight."""
    urls: list[str] = []
    """Running vLLM servers to use instead of starting engines (flags: molt.vllm_server + refit's); the
    run first pushes its initial weights into them. The flags of the engines molt starts are then refused."""
    max_restarts: Annotated[int, Meta(ge=0)] = 3
    """Times each engine molt started is restarted after it dies (then given the current weights before it
    serves); one more death (with 0: the first) stops the run with its log's first error. Engines of
    --vllm.urls are never restarted: one that dies is dropped for the rest of the run."""
    tensor_parallel_size: Annotated[int, Meta(ge=1)] = 1
    """Tensor parallelism per engine."""
    data_parallel_size: Annotated[int, Meta(ge=1)] = 1
    """Data parallelism per engine; raises expert parallelism past TP."""
    enable_expert_parallel: bool = False
    """Expert parallelism per engine (EP = TP x DP)."""
    max_num_batched_tokens: Annotated[int, Meta(ge=1)] | None = None
    """Scheduler token budget per engine step; none = vLLM's default."""
    stream_interval: Annotated[int, Meta(ge=0)] = 16
    """N: the engines molt starts stream every reply to tito, N tokens at a time (vLLM's
    --stream-interval), also those an agent takes whole. 0: each reply comes whole, once it finishes:
    vLLM then builds its per-token logprobs at the end, and replies that finish in the same step are
    answered one after another while the GPU waits (on one H100, 128 replies of 512 tokens: 2.4 s from
    the first answered to the last whole, 0.4 s streamed; BENCHMARKS.md). Attached engines (--vllm.urls)
    answer whole."""
    mtp_num_speculative_tokens: Annotated[int, Meta(ge=0)] = 0
    """MTP speculative tokens per step (rollout only); 0 disables speculative decoding."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prefixes."""
    cuda_graphs: bool = True
    """Capture CUDA graphs (CUDA only: the CPU engine runs eager); false runs the engine eager, uncompiled."""
    compile: bool = True
    """Compile the engine's model with vLLM's torch.compile passes (CUDA only). false skips them: at start-up
    the engine traces, compiles or loads from vLLM's cache no graph, and it decodes through full CUDA
    graphs only (--vllm.cuda_graphs), prompts eager, without the compiled fusions: for short runs of
    small models, where the engine's start-up can be a run's longest stage."""
    max_model_len: Annotated[int, Meta(ge=2)] = 2048
    """Longest prompt plus response, in tokens."""
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1)] | None = None
    """Fraction of its GPU's memory an engine may take; none = 0.8 on GPUs of its own, 0.4 on a GPU it
    shares with the actor (see --vllm.placement)."""
    kv_cache_tokens: Annotated[int, Meta(ge=0)] = 0
    """KV cache of each engine GPU, in tokens (CUDA engines); 0 = what the run can fill: every sequence
    in flight (--rollout.queue_depth x --rollout.group_size, plus the eval's) at --vllm.max_model_len,
    when that fits in --vllm.gpu_memory_utilization (else vLLM sizes it from that). A larger cache costs
    every refit time: its cache reset walks every block."""
    placement: Literal["auto", "shared", "separate"] = "auto"
    """GPUs: separate = each engine and actor rank on its own (NCCL refit); shared = the engine and the actor
    on one GPU (CUDA IPC refit); auto = shared when a local Ray has too few GPUs for separate."""
    mps: Literal["auto", "on", "off"] = "auto"
    """A shared GPU's processes (engine and actor) as clients of a CUDA MPS server the run starts for
    itself (NVIDIA's nvidia-cuda-mps-control): their kernels run side by side instead of taking turns in
    time slices (on one H100, Qwen3-1.7B with 128 replies of 512 tokens a step: 4.0 s a step against 5.2).
    on = needs --vllm.placement shared (or auto deciding it), a local Ray and the MPS binary on PATH; auto =
    on where those hold and no MPS server serves the run already, and a daemon that fails to start is
    noted instead of stopping the run; off = the processes take turns, as without MPS."""


class Rollout(_Group):
    """Sampling and the streaming prompt-group pool."""

    group_size: Annotated[int, Meta(ge=1)] = 8
    """Samples per prompt (one group)."""
    prompts_per_step: Annotated[int, Meta(ge=1)] = 16
    """Prompt groups per optimizer step."""
    max_new_tokens: Annotated[int, Meta(ge=1)] = 2
    """Most tokens sampled per LLM turn."""
    temperature: Annotated[float, Meta(gt=0)] = 1.0
    """Sampling temperature; the trainer applies the same one to its logits."""
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    """Nucleus sampling threshold; only 1 is accepted (the trainer's full softmax cannot reproduce the
    engine's renormalisation over the nucleus)."""
    queue_depth: Annotated[int, Meta(ge=0)] = 0
    """Prompt groups in flight; 0 = 2 x --rollout.prompts_per_step."""
    max_lag: Annotated[int, Meta(ge=0)] = 1
    """Most policy versions a group's oldest token may lag the trainer."""
    stale: Literal["drop", "keep"] = "keep"
    """A group past --rollout.max_lag (the pool admits a group only when it can be trained in time, so
    this is rare: one overtaken by faster ones): keep it and train it corrected, or drop it and rerun its
    prompt (its tokens wasted)."""
    max_stale_requeues: Annotated[int, Meta(ge=1)] = 16
    """With --rollout.stale drop: reruns of one prompt after stale drops before the run stops, naming it."""
    partial_rollout: bool = True
    """Keep in-flight requests across weight refits (their tokens mix versions)."""
    seed_requests: bool = False
    """Seed each Env request from --train.seed, its row, sample and turn: the same weights sample the same
    tokens again (reproducible runs and resumes)."""


class Train(_Group):
    """The training run."""

    num_steps: Annotated[int, Meta(ge=1)] = 100
    """Optimizer steps in the run."""
    seed: Annotated[int, Meta(ge=0)] = 0
    """Seed of the trainer and the samplers."""
    mini_batches: Annotated[int, Meta(ge=1)] = 2
    """Optimizer steps per batch: the batch splits into this many windows of whole rollouts (a seeded
    permutation, from --train.seed and the step), each its own step with its own denominator; the ratio of
    every loss kind is taken against the policy before the first (the first window's logprobs from its own
    forward, the others' from one pass before it), so from the second window on the clip acts
    (train/clip_frac, over those windows). 1: one step, the ratio is 1 and
    every kind acts as pg."""
    force_on_policy: bool = False
    """Strict on-policy: sets --rollout.max_lag 0, --rollout.partial_rollout false, queue depth = one step."""
    routing_replay: bool = False
    """Replay the engines' MoE routing in the trainer (R3): each token goes to the experts the engine
    used; logs train/routing_mismatch_frac. Needs CUDA engines (vLLM captures routes on GPU only)."""
    rollout_dump_dir: str = ""
    """Directory for JSONL dumps of every trained rollout (read with molt.read_rollouts); empty = none."""


class Eval(_Group):
    """Evaluation on held-out rows: pass@k from n samples per prompt, logged as eval/*."""

    every: Annotated[int, Meta(ge=0)] = 0
    """Evaluate after every this many optimizer steps (and after the last); 0 = never."""
    path: str = ""
    """JSONL evaluation rows; empty = the agent module's eval_dataset(seed), else dataset(other seed)."""
    num_prompts: Annotated[int, Meta(ge=1)] = 32
    """Evaluation prompts per evaluation (the first ones of the set)."""
    n: Annotated[int, Meta(ge=1)] = 4
    """Samples per evaluation prompt."""
    k: Annotated[int, Meta(ge=1)] = 1
    """k of the reported pass@k (k <= n)."""
    pass_reward: float = 1.0
    """A sample passes when its reward is at least this."""


class Ckpt(_Group):
    """Checkpoints."""

    every: Annotated[int, Meta(ge=0)] = 0
    """Save every this many optimizer steps; 0 = never."""
    dir: str = ""
    """Checkpoint directory; empty = <run_dir>/checkpoints."""


class Logger(_Group):
    """The run directory and metric sinks."""

    run_dir: str = ""
    """Run directory (config, metrics.jsonl, events, checkpoints); empty = runs/<UTC timestamp>."""
    tensorboard: bool = True
    """Write TensorBoard events into the run directory."""
    wandb_project: str = ""
    """Weights & Biases project: a run offline under <run_dir>/wandb (WANDB_MODE=online logs live); needs
    the wandb extra; empty = no W&B."""
    verbose: bool = False
    """Show other libraries' output (warnings, progress bars, Ray workers' logs) on the console; default:
    into the run directory's *.log files, molt's own lines and every error on the console."""


class Ray(_Group):
    """Ray, which places engines and actors."""

    address: str = ""
    """Ray cluster address to join; empty = start a local Ray."""
    num_cpus: Annotated[int, Meta(ge=1)] | None = None
    """CPUs of the local Ray; none = all of them."""


class Refit(_Group):
    """Weight refit from the trainer into the engines (the refit library); every refit is verified."""

    delta: bool = False
    """Send each engine only the weight elements that changed since its last refit (per bucket, in the
    engine's dtype; a bucket that changed densely goes whole). CPU engines (refit_gloo) only. Pays where
    engines run bf16 and most bf16 values survive a step; an fp32 engine's elements all change."""


class Config(_Group):
    """A whole molt run: one field per flag group; a group's class docstring is its heading in --help."""

    model: Model = Model()
    data: Data = Data()
    agent: Agent = Agent()
    algo: Algo = Algo()
    actor: Actor = Actor()
    fsdp: FSDP = FSDP()
    vllm: VLLM = VLLM()
    rollout: Rollout = Rollout()
    train: Train = Train()
    eval: Eval = Eval()
    ckpt: Ckpt = Ckpt()
    logger: Logger = Logger()
    ray: Ray = Ray()
    refit: Refit = Refit()


def with_run_dir(config: Config, now: datetime.datetime | None = None) -> Config:
    """The config with --logger.run_dir (runs/<UTC timestamp>) and --ckpt.dir (<run_dir>/checkpoints) set."""
    now = now or datetime.datetime.now(datetime.UTC)
    run_dir = config.logger.run_dir or str(Path("runs") / now.strftime("%Y%m%d-%H%M%S"))
    ckpt_dir = config.ckpt.dir or str(Path(run_dir) / "checkpoints")
    return msgspec.structs.replace(
        config,
        logger=msgspec.structs.replace(config.logger, run_dir=run_dir),
        ckpt=msgspec.structs.replace(config.ckpt, dir=ckpt_dir),
    )
