"""The job's one typed config: pydantic sections, YAML file plus dotted ``key=value`` overrides.

Unknown keys and wrong types are errors with the full dotted path and, for a misspelt key, a suggestion. The resolved
config is written into the run directory as ``config.yaml``.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from teachers.config import TeachersConfig
from trainer import registry
from trainer.config import TrainerConfig


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ModelConfig(Section):
    path: str = "runs/models/demo-init"
    """Local Hugging Face model directory (config.json, *.safetensors, tokenizer.json)."""
    init_if_missing: bool = True
    """Create a small random model at ``path`` (``agentflow model init``) when the directory does not exist."""
    init_seed: int = 0
    """Seed of the model created by ``init_if_missing``."""
    init_arch: Literal["qwen2", "qwen3", "qwen3_moe"] = "qwen2"
    """Architecture of the model created by ``init_if_missing`` (``qwen3_moe``: 8 experts, top-2)."""


class EnvConfig(Section):
    id: str = "agentflow/Calc-v0"
    """Registered environment id (``agentflow envs list``)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for ``envs.make``."""


class DataSourceConfig(Section):
    env_id: str
    """Registered environment id."""
    task_set: str = "default"
    """The env's task set to draw from."""
    weight: float = Field(1.0, gt=0)
    """Relative share of the draws."""
    tags: list[str] = Field(default_factory=list)
    """Labels carried by its trajectories (what teachers route on)."""
    name: str = ""
    """Unique name (default ``ENV_ID:TASK_SET``)."""
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for ``envs.make``."""


class DataConfig(Section):
    sources: list[DataSourceConfig] = Field(default_factory=list)
    """RL data sources mixed by weight; empty: the ``env`` section's env with its default task set."""
    seed: int = 0
    """Seed of the mixture's draws."""


class TreeConfig(Section):
    branches: int = Field(0, ge=0)
    """Continuations per group started from the state after one of its roots' turns (0: no tree)."""
    select: Literal["uniform", "last_first", "surprisal", "disagree", "contested"] = "disagree"
    """Where to branch: turns at random, the deepest first, where the sampled tokens were least likely, (the
    default) the states where the roots took the most different actions, then by surprisal, or ``contested``: only
    states where the roots disagreed, the branches cycling over them (no branch in a group whose roots agreed)."""
    max_tokens: int | None = Field(None, ge=1)
    """Generated tokens per group (roots and branches) past which no further branch starts (None: no bound)."""


class RolloutConfig(Section):
    group_size: int = Field(4, ge=1)
    """Trajectories sampled per task (GRPO group)."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature of rollouts."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling cut-off."""
    max_new_tokens: int = Field(64, ge=1)
    """New tokens per model turn."""
    max_concurrency: int = Field(32, ge=1)
    """Episodes in flight at once (bounded further by the store's window)."""
    episode_retries: int = Field(4, ge=0)
    """Replays of an episode whose engine or env worker died under it, 1, 2, 4, 8, 8... s apart so a restarting actor
    can come back (after the last, it stays an ``error`` trajectory)."""
    reset_timeout_s: float = Field(300.0, gt=0)
    """Seconds one env reset may take; past it the episode ends ``error`` with the reason and the env is dropped."""
    step_timeout_s: float = Field(300.0, gt=0)
    """Seconds one env step may take (a tool call, or the final answer and its verifier); past it the episode ends
    ``error`` with the reason, its slot is freed and the env is dropped (a hung call cannot hold the job)."""
    tree: TreeConfig = Field(default_factory=TreeConfig)
    """Sparse reverse trees (agentflow/tree.py): branches from the roots' turns, for ``trainer.tree_credit``."""
    partial: Literal["continue", "recycle", "pin"] = "continue"
    """Partial rollouts at a weight update: in-flight generations ``continue`` under the new version (each token
    stamped with its own), or are aborted and ``recycle``d (run again from the same input under the new one), or
    each episode is ``pin``ned to the version current at its start (the embedded engine serves the last
    ``stale_steps + 1`` versions at once, one copy of the weights each; no trajectory holds two versions)."""


class AgentConfig(Section):
    type: str = "whitebox"
    """The agent (agentflow/agents.py): ``whitebox`` (our token loop), ``blackbox`` (an OpenAI-API program through
    the recording proxy), a name registered with ``register_agent`` or declared as an ``agentflow.agents`` entry
    point, or ``module:Class`` (a :class:`~agentflow.agents.BaseAgent` built with this section's settings)."""
    context: Literal["truncate", "compact"] = "truncate"
    """Whitebox: a full context ends the episode, or continues it in a new ``compact`` segment."""
    unfinished_turn: Literal["act", "end"] = "act"
    """Whitebox: a reply cut at ``rollout.max_new_tokens`` before its end token is still handed to the env
    (``act``), or ends the episode there, ``truncated`` with reward 0 (``end``: a run-on reply is never rewarded,
    even where the env's parser would accept its start)."""
    entry: str | None = None
    """Blackbox: the program as a Python callable ``module:function`` taking a ``BlackBoxTask``."""
    command: list[str] | None = None
    """Blackbox: the program as a command (``{python}`` = this interpreter), given ``OPENAI_BASE_URL`` etc."""
    timeout_s: float = Field(120.0, gt=0)
    """Blackbox: seconds one episode's program may run before it is killed (the episode ends ``error``)."""
    train_side_calls: bool = False
    """Blackbox: also train the calls that continue no conversation and carry no ``X-AgentFlow-Segment`` header
    (``side`` segments) and the replies an agent dropped by asking again (``retry``); by default they are recorded
    in the trajectory but not trained."""
    model_name: str = "agentflow-policy"
    """Blackbox: the model name the proxy serves."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra settings for a user-registered agent."""


class ElasticChange(Section):
    at_step: int = Field(ge=1)
    """After this RL step (its weights already in the engines) ..."""
    engines: int = Field(ge=1)
    """... the job has this many engines: new ones start with the newest weights before they serve, surplus ones
    take no new trajectory, finish their requests in flight and close."""


class EngineConfig(Section):
    type: Literal["embedded", "sglang"] = "embedded"
    """Inference engine: the in-process CPU engine, or SGLang-protocol servers over HTTP (``urls``)."""
    max_slots: int = Field(32, ge=1)
    """Sequences decoded together (KV cache slots)."""
    max_len: int = Field(640, ge=16)
    """Tokens per KV cache slot (prompt + all turns)."""
    prefix_cache: bool = True
    """Embedded: keep finished sequences' KV in idle slots so a resumed episode pays only for its new tokens."""
    kv_on_update: Literal["flush", "keep", "recompute"] = "flush"
    """What a weight update does to cached prefixes (KV of paused episodes): ``flush`` drops them (and, once it ends,
    the KV of a request that decoded across the update, which was running when the flush came); ``keep`` reuses
    the old weights' KV (the recorded log-probs are what was sampled over it, so the importance ratio corrects for
    it; SGLang: updates without flushing its radix cache); ``recompute`` (embedded) prefills them again under the new
    weights while the engine has nothing else to do."""
    admission: Literal["fifo", "resumed_first"] = "fifo"
    """Embedded: queued requests start in arrival order, or ``resumed_first``: a paused episode's next turn (it
    continues a cached context) goes ahead of new episodes when slots are short."""
    kv_paused_aware: bool = False
    """Embedded: protect paused episodes' cached contexts: when a slot is needed, entries of ended episodes go
    first, then entries idle past their time-to-live, then the least recently used; a request that shares only a
    prefix with a live entry gets those positions copied into a free slot instead of cutting the entry (on the
    long-horizon job: prefix tokens reused 0.79 -> 0.87 of prompt tokens; throughput within noise, see
    docs/results.md). False: plain least-recently-used eviction, and a shared-prefix hit takes the entry's slot."""
    kv_ttl_s: float | None = Field(None, gt=0)
    """Embedded: how long an idle cached entry counts as a paused episode's (kept ahead of older ones; spilled
    rather than dropped); None: learned, twice the p90 of measured gaps between a turn's end and the next turn."""
    kv_spill_bytes: int = Field(0, ge=0)
    """Embedded: host memory for a second tier of cached entries: a live entry displaced from its slot is copied
    there and copied back when its episode resumes (0: displaced entries are dropped)."""
    kv_max_age: int | None = Field(None, ge=0)
    """``keep``/``recompute``: cached KV more than this many versions old is dropped at an update (default: the
    job's staleness bound)."""
    elastic: list[ElasticChange] = Field(default_factory=list)
    """Resize the engine pool while the job runs (embedded engines, or engine actors under Ray), e.g.
    ``[{at_step: 10, engines: 2}, {at_step: 30, engines: 1}]``. A trajectory sticks to one engine; one whose engine
    leaves continues on another (its prefix is prefilled there again)."""
    drain_timeout_s: float = Field(60.0, gt=0)
    """How long a leaving engine may finish its requests in flight before they are aborted (partial outputs)."""
    urls: list[str] = Field(default_factory=list)
    """SGLang: server base URLs, e.g. ``["http://127.0.0.1:30000"]`` (one trajectory sticks to one server)."""
    api_key: str | None = None
    """SGLang: the run's key for state-changing endpoints (``Authorization: Bearer``); see ``api_key_env``."""
    api_key_env: str | None = "AGENTFLOW_ENGINE_KEY"
    """SGLang: environment variable holding the key when ``api_key`` is unset (keeps it out of saved configs)."""
    request_timeout: float = Field(3600.0, gt=0)
    """SGLang: seconds one HTTP request may take (a long generation included)."""
    max_retries: int = Field(3, ge=0)
    """SGLang: retries of a request on another server after a connection error."""
    health_interval: float = Field(5.0, gt=0)
    """SGLang: seconds between ``/health`` checks of servers marked unhealthy."""
    routed_experts: bool = False
    """``sglang`` serving a mixture-of-experts model: ask for each token's routed experts (``return_routed_experts``;
    the servers need ``--enable-return-routed-experts``) for ``trainer.routing_replay``. The embedded engine always
    records them."""


class ReplayConfig(Section):
    max_reuse: int = Field(0, ge=0)
    """Times a trained group may be trained again (0: no replay). Each time every one of its tokens must still be
    within ``store.stale_steps`` versions of the trainer, so reuse beyond ``stale_steps`` never happens."""
    ratio: float = Field(0.5, ge=0.0, lt=1.0)
    """``fixed``: the share of each batch's groups taken from replay (``round(ratio * B)``, fewer while fewer are
    eligible); ``adaptive``: at most ``round(ratio * B)`` replays per batch. A batch always keeps one fresh group."""
    schedule: Literal["fixed", "adaptive"] = "fixed"
    """``adaptive`` replays only what generation cannot supply while one batch trains, from the measured rate of
    finished groups and the trainer's step cost per group (decisions logged every step as ``store/replay_*``)."""
    skip_uniform: bool = True
    """Do not keep groups whose rewards are all equal: under group-relative advantages they have no policy gradient."""
    stale_steps: int | None = Field(None, ge=1)
    """A tighter staleness bound for replayed groups than for fresh ones (null: the job's bound): a group is replayed
    only while every one of its tokens is within this many versions of the trainer. At most the job's bound."""


class StoreConfig(Section):
    batch_groups: int = Field(8, ge=1)
    """B: groups per train step."""
    stale_steps: int = Field(1, ge=0)
    """Largest allowed staleness (trainer version - oldest token version) of a trained trajectory."""
    collect: Literal["fifo", "first_finished"] = "fifo"
    """Which finished groups make a batch: ``fifo`` the B oldest-dispatched (waits for the slowest; trains episode
    lengths as sampled), ``first_finished`` the B earliest-finished in the window (less waiting; slow, i.e. long,
    episodes that pass the staleness bound are dropped unless ``length_aware``)."""
    length_aware: bool = True
    """``first_finished`` only: take the groups whose staleness deadline would otherwise be missed first (waiting for
    them if need be), so no group is dropped for being slow and training is not skewed toward short episodes."""
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    """Bounded replay: trained groups trained again, within the staleness bound, to keep the trainer busy."""


class SFTConfig(Section):
    enabled: bool = True
    """Warm up with supervised fine-tuning on the scripted expert's traces (of the ``env`` section's env) before RL;
    a job whose env has no expert is refused unless ``sft.expert`` names one or this is false."""
    expert: str | None = None
    """Scripted expert, ``module:function`` taking ``(env, history)`` and returning a canonical action string;
    unset: the expert the env declares (``envs.register(..., expert=...)``)."""
    episodes: int = Field(512, ge=1)
    """Scripted training episodes to imitate."""
    val_episodes: int = Field(64, ge=1)
    """Scripted validation episodes (loss curve and early stopping)."""
    max_epochs: int = Field(20, ge=1)
    """Upper bound on epochs; training stops when validation loss stops improving."""
    patience: int = Field(2, ge=1)
    """Epochs without validation improvement before stopping."""
    stop_val_loss: float | None = Field(None, gt=0)
    """Stop as soon as validation loss is at or below this, keeping those weights (unset: run until ``max_epochs``
    or ``patience``). The LR schedule still spans ``max_epochs``, so stopping early ends it before its decay."""
    lr: float = Field(1e-3, gt=0)
    """SFT learning rate."""
    observation_weight: float = Field(0.0, ge=0, le=1)
    """Weight of the prompt's and the environment's tokens in the training loss, against 1 for the expert's actions
    (0: actions only). A model made from scratch has read nothing but these traces, and its actions are a few
    dozen tokens an episode against hundreds of observation tokens, which repeat the task and the screen turn after
    turn; weighing them in gives it more to learn its context from. Validation loss stays on the actions alone."""
    batch_size: int = Field(16, ge=1)
    """Sequences per SFT step."""
    warmup_steps_max: int = Field(50, ge=0)
    """The LR warms up linearly over a tenth of the SFT steps, at most this many, then decays (cosine)."""
    threads: int = Field(2, ge=1)
    """Torch threads of the SFT trainer (nothing else runs during warm-up, so it may use every core)."""


class EvalConfig(Section):
    episodes: int = Field(200, ge=1)
    """Held-out (eval split) episodes per evaluation, greedy decoding."""
    every_steps: int = Field(0, ge=0)
    """Evaluate every N RL steps (0: only before and after RL)."""
    pause_rollouts: bool = False
    """While an in-loop evaluation (``every_steps``) runs, start no RL episode (of a new group or of one dispatched
    already and waiting for a ``rollout.max_concurrency`` slot); episodes already running finish.
    Off: RL rollouts go on beside the evaluation and the trainer finds their groups waiting after it (more data per
    second of the job). On: the evaluation has the engines to itself, and the RL time around it measures RL alone,
    which comparisons of RL speed need (otherwise generation gets the evaluation's time for free)."""


class RayConfig(Section):
    enabled: bool = False
    """Run engines, the trainer group and env workers as Ray actors (restarted by Ray when they die)."""
    address: str | None = None
    """Cluster to join (``auto`` or ``HOST:PORT``); unset: ``RAY_ADDRESS`` if set, else a local cluster whose files
    stay in the run directory."""
    num_cpus: int = Field(2, ge=1)
    """CPUs of a local cluster."""
    actor_cpus: float = Field(0.1, gt=0)
    """CPUs reserved per actor (the actors mostly wait; the OS shares the cores)."""
    engines: int = Field(1, ge=1)
    """Engine actors (a trajectory sticks to one)."""
    env_workers: int = Field(2, ge=1)
    """Env worker actors, each hosting many envs."""
    placement: Literal["colocated", "separate"] = "colocated"
    """Actors without labels (below) packed on as few nodes as possible, or spread across nodes."""
    max_restarts: int = Field(3, ge=0)
    """Restarts Ray grants a dead engine or env worker."""
    engine_labels: dict[str, str] = Field(default_factory=dict)
    """Ray node labels the engines run on, as a label selector (``{"agentflow/role": "rollout"}``; values may be
    ``!v`` or ``in(a,b)``). Empty: placed by ``placement``."""
    env_worker_labels: dict[str, str] = Field(default_factory=dict)
    """Ray node labels the env workers run on (a label selector, as ``engine_labels``)."""
    trainer_labels: dict[str, str] = Field(default_factory=dict)
    """Ray node labels the trainer group runs on (a label selector, as ``engine_labels``)."""
    on_node_loss: Literal["replace", "wait"] = "replace"
    """When every node matching an actor's labels is gone: ``replace`` restarts it on any remaining node (and a
    resumed job places its trainer there); ``wait`` keeps it pending until a matching node joins (a job waits
    ``recover_timeout_s`` for it)."""
    recover_timeout_s: float = Field(300.0, gt=0)
    """How long the job waits for a dead engine to come back (restarted, re-placed or on a new node) before failing."""


class RunConfig(Section):
    dir: str = "runs/demo"
    """Run directory: config, journal, metrics, checkpoints, summary."""
    mode: Literal["async", "one_step", "sync"] = "async"
    """``async``: rollouts continue while the trainer steps, up to ``store.stale_steps`` versions ahead;
    ``one_step``: the same with ``stale_steps`` fixed at 1 (the next batch is generated while this one trains);
    ``sync``: generate a batch, then train (``stale_steps`` 0, dispatch closed while training)."""
    steps: int = Field(20, ge=0)
    """RL steps (optimizer steps, each one weight version)."""
    max_generated_tokens: int | None = Field(None, gt=0)
    """Budget of generated model tokens: the job stops after the step at which the accepted trajectories' model
    tokens (trained or not; a branch counts what it generated itself; a resumed run counts its journal) reach it,
    or after ``steps``, whichever comes first. For comparing methods at equal inference compute."""
    overwrite: bool = False
    """Start over in a run directory that already holds a run (its journal, metrics, checkpoints and summary are
    removed first); otherwise such a directory is refused, and ``agentflow train --resume DIR`` continues it."""
    seed: int = 0
    """Seed of task sampling."""
    checkpoint_every: int = Field(0, ge=0)
    """Save a checkpoint every N steps (0: only at the end)."""
    threads: int = Field(1, ge=1)
    """Torch threads per process."""
    cpus: list[int] | None = None
    """CPU cores the job's own process runs on during RL (Linux): the controller, its embedded engines, agents, env
    workers and the programs they start. Unset: every core it may use. With ``trainer_cpus`` on other cores, replay
    or a long training step cannot take CPU from generation. Not under Ray (place actors by labels there)."""
    trainer_cpus: list[int] | None = None
    """CPU cores the RL trainer's processes run on (Linux); unset: the cores the job started with. The warm-up's
    trainer is not pinned (it runs alone). Not under Ray."""
    progress: bool = True
    """Show a progress bar."""
    silent_steps_warn: int = Field(10, ge=0)
    """Warn on stderr when this many consecutive steps had batches in which every episode got the same reward, so
    the outcome reward trained nothing (after a collapse every episode fails; ``summary.json``'s ``silent_steps``
    reports the longest such run). 0: no warning. Not for distillation jobs, which learn from their teachers."""
    stop_after_silent_steps: int = Field(0, ge=0)
    """Stop the job (as after ``run.steps``: summary, checkpoint and evaluation written) after this many such steps
    in a row; 0: never."""

    @field_validator("cpus", "trainer_cpus")
    @classmethod
    def _cores(cls, cores: list[int] | None) -> list[int] | None:
        if cores is not None and (not cores or min(cores) < 0 or len(set(cores)) != len(cores)):
            raise ValueError(f"{cores}: a list of distinct core numbers (0, 1, ...), at least one")
        return cores


STALENESS_BY_MODE = {"sync": 0, "one_step": 1}
"""``run.mode`` fixes the staleness bound; ``async`` takes ``store.stale_steps``."""


class JobConfig(Section):
    """One RL job."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    teachers: TeachersConfig = Field(default_factory=TeachersConfig)
    """On-policy distillation from teachers routed by data-source tag (``agentflow distill``)."""
    transfer: dict[str, Any] = Field(default_factory=lambda: {"type": "inprocess"})
    """TransferMesh weight transport, tagged by ``type`` (inprocess | gloo | http | cuda_ipc); see
    transfer_mesh/transport.py."""

    @model_validator(mode="after")
    def _cores_are_local(self) -> JobConfig:
        pinned = [k for k in ("cpus", "trainer_cpus") if getattr(self.run, k) is not None]
        if pinned and self.ray.enabled:
            raise ValueError(f"run.{pinned[0]} pins local processes; under Ray (ray.enabled) labels place the actors")
        return self

    @model_validator(mode="after")
    def _elastic_engines(self) -> JobConfig:
        steps = [c.at_step for c in self.engine.elastic]
        if len(steps) != len(set(steps)):
            raise ValueError(f"engine.elastic: two changes at the same step ({sorted(steps)})")
        if steps and self.engine.type == "sglang" and not self.ray.enabled:
            raise ValueError("engine.elastic: SGLang servers are started outside the job; list them in engine.urls")
        if steps and self.transfer.get("type") != "inprocess":
            raise ValueError(
                f"engine.elastic: engines that join get the newest weights in process; transfer.type "
                f"{self.transfer.get('type')!r} sends to a fixed set of engines (use inprocess)"
            )
        return self

    @model_validator(mode="after")
    def _kv_on_update(self) -> JobConfig:
        """The engine section says what an update does to the KV; TransferMesh's ``flush_cache`` follows it."""
        e = self.engine
        if e.kv_on_update == "recompute" and e.type == "sglang":
            raise ValueError(
                "engine.kv_on_update: recompute re-prefills cached prefixes inside the embedded engine; SGLang "
                "servers can flush or keep their radix cache (use flush or keep)"
            )
        embedded_only = {"admission": e.admission != "fifo", "kv_ttl_s": e.kv_ttl_s is not None,
                         "kv_spill_bytes": e.kv_spill_bytes > 0, "kv_paused_aware": e.kv_paused_aware}  # fmt: skip
        set_keys = [k for k, v in embedded_only.items() if v]
        if e.type == "sglang" and set_keys:
            raise ValueError(
                f"engine.{set_keys[0]}: the embedded engine's cache setting; SGLang servers manage their own radix "
                "cache and queue (set them on the servers)"
            )
        if e.kv_on_update == "flush" and self.transfer.get("flush_cache") is False:
            raise ValueError(
                "transfer.flush_cache: false keeps the engines' KV across updates; say engine.kv_on_update: keep "
                "(one setting, which the engines and the transport both follow)"
            )
        self.transfer["flush_cache"] = e.kv_on_update == "flush"
        if e.kv_max_age is None:
            e.kv_max_age = STALENESS_BY_MODE.get(self.run.mode, self.store.stale_steps)
        return self

    @model_validator(mode="after")
    def _pin_needs_versions(self) -> JobConfig:
        if self.rollout.partial != "pin":
            return self
        why = None
        if self.engine.type != "embedded":
            why = "engine.type: an SGLang server serves one weight version at a time"
        elif self.engine.elastic:
            why = "engine.elastic: an engine that joins holds only the newest version"
        elif self.ray.enabled:
            why = "ray.enabled: engine actors do not take the versions to keep yet"
        elif self.agent.type != "whitebox":
            why = f"agent.type {self.agent.type!r}: only the whitebox loop pins its episodes"
        elif self.engine.kv_on_update != "flush":
            why = "engine.kv_on_update: a pinned episode keeps its own version's KV across updates by itself"
        if why:
            raise ValueError(f"rollout.partial: pin needs the embedded engine serving several versions; {why}")
        return self

    @model_validator(mode="after")
    def _tree_needs_our_loop(self) -> JobConfig:
        if self.rollout.tree.branches and self.rollout.partial != "continue":
            raise ValueError(
                f"rollout.tree: branches run outside the agent's partial-rollout handling; rollout.partial "
                f"{self.rollout.partial!r} applies to roots only (use continue)"
            )
        if self.rollout.tree.branches and self.agent.type != "whitebox":
            raise ValueError(
                f"rollout.tree: branches continue the white-box loop from a recorded turn; agent.type "
                f"{self.agent.type!r} runs its own program"
            )
        return self

    @model_validator(mode="after")
    def _replay_needs_staleness(self) -> JobConfig:
        if self.store.replay.max_reuse > 0 and self.run.mode == "sync":
            raise ValueError(
                "store.replay.max_reuse: replay needs a staleness bound above 0, and run.mode sync trains only tokens "
                "of the current version (use async with store.stale_steps >= 1, or one_step)"
            )
        bound = STALENESS_BY_MODE.get(self.run.mode, self.store.stale_steps)
        if self.store.replay.stale_steps is not None and self.store.replay.stale_steps > bound:
            raise ValueError(
                f"store.replay.stale_steps={self.store.replay.stale_steps} is above the job's staleness bound {bound} "
                f"(run.mode {self.run.mode}): replayed tokens may not be staler than fresh ones"
            )
        return self

    @model_validator(mode="after")
    def _teacher_estimators(self) -> JobConfig:
        """The teachers' estimators are the trainer's (one registry); ``teachers`` cannot import the trainer."""
        t = self.teachers
        try:
            registry.check("kl_estimator", t.reward_estimator)
            registry.check("distill_loss_estimator", t.loss_estimator)
        except ValueError as e:
            field = "reward_estimator" if "kl_estimator" in str(e) else "loss_estimator"
            raise ValueError(f"teachers.{field}: {e}") from None
        if t.loss_coef > 0 and t.loss_estimator in registry.FULL_VOCAB_ESTIMATORS:
            served = [m.name for m in t.models if m.path is None]
            if served:
                raise ValueError(
                    f"teachers.loss_estimator: {t.loss_estimator} needs each teacher's full next-token distribution, "
                    f"which the trainer computes from a model directory; teacher {served[0]!r} is a server URL (give "
                    "it a path, or use k1, k2, k3 or topk)"
                )
        return self

    @field_validator("transfer")
    @classmethod
    def _check_transfer(cls, v: dict[str, Any]) -> dict[str, Any]:
        from transfer_mesh.transport import parse_transport_config

        return parse_transport_config(v).model_dump()


def _parse_value(text: str) -> Any:
    return yaml.safe_load(text) if text != "" else ""


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, f in model.model_fields.items():
        keys.append(prefix + name)
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _known_keys(ann, prefix + name + ".")
    return keys


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, _known_keys(JobConfig), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def apply_override(data: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not key=value")
    key, value = item.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{key}': '{p}' is not a section")
    node[parts[-1]] = _parse_value(value)


def _format_error(err: ValidationError) -> str:
    e = err.errors()[0]
    key = ".".join(str(x) for x in e["loc"])
    if not e["loc"]:  # a whole-config check names its own key
        return str(e["msg"]).removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        return f"unknown config key '{key}'.{_suggest(key)}"
    return f"config key '{key}': {e['msg']} (got {e.get('input')!r})"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML config (or start from defaults), apply dotted overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if data is None:  # an empty file is a mistake, not a request for the default job
            raise ConfigError(f"config file {p} is empty (omit the file to run with the defaults)")
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
    for item in overrides or []:
        apply_override(data, item)
    try:
        return JobConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


def save_config(cfg: JobConfig, run_dir: str | Path) -> Path:
    out = Path(run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return out
