"""The run configuration: one TOML file, validated once, read by the stack, the functions and participants.

Every knob of a run lives here so that the coordinator, the participants and `cdk deploy` can never
disagree about a timeout or a limit.
"""

from __future__ import annotations

import tomllib
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared.compress import TOPK_BITS, Encoding
from shared.initial_models import task_model_schema
from shared.keys import RUN_ID_PATTERN
from shared.naming import PARTICIPANT_QUEUE_MARK
from shared.optimizers import OPTIMIZERS
from shared.strategies import STRATEGIES


class ConfigError(ValueError):
    """A run configuration that cannot be used, with a message naming every bad field."""


# How a round's updates are combined: the names of the strategies `shared.strategies` registers, its one list.
Strategy = StrEnum("Strategy", [(name.upper(), name) for name in STRATEGIES])  # type: ignore[misc]


# What the coordinator does with a round's aggregate: the names of the server optimizers `shared.optimizers`
# registers (none: the aggregate is the next global model; fedavgm, fedadam, fedyogi, diloco), its one list.
ServerOptimizer = StrEnum("ServerOptimizer", [(name.upper(), name) for name in OPTIMIZERS])  # type: ignore[misc]


class DataMode(StrEnum):
    """Where a participant's training data comes from."""

    ASSIGNED = "assigned"  # one shared training set; each round the coordinator assigns index slices of it
    LOCAL = "local"  # each participant's own (private) data; it registers its sample count when it joins


class WorkSizing(StrEnum):
    """How a round's work is divided among its selected participants (`shared.sizing`)."""

    THROUGHPUT = "throughput"  # in proportion to each one's measured throughput: all predicted to finish together
    EQUAL = "equal"  # equal shares, whatever each host's speed


class UpdateEncoding(StrEnum):
    """What a participant uploads (`shared.compress`)."""

    WEIGHTS = "weights"
    BF16 = "bf16"
    INT8 = "int8"
    TOPK = "topk"


class DownloadEncoding(StrEnum):
    """What participants download each round (`shared.delta`)."""

    FULL = "full"
    BF16 = "bf16"
    INT8 = "int8"
    TOPK = "topk"


class Adapter(StrEnum):
    """What a Hugging Face run trains (`participant.tasks.hf`)."""

    NONE = "none"  # every weight: an update is the whole model
    LORA = "lora"  # low-rank adapters on a frozen base (PEFT): an update is the adapters only


DIGEST_PATTERN = r"^([0-9a-f]{64})?$"
# The window `upload_budget` counts a participant's uploads in: a minute of the events' own time (set by S3, not by
# the uploader), not the round an object names, since any round can be named and each named round would be a
# budget of its own.
UPLOAD_WINDOW_SECONDS = 60


class HfOptions(BaseModel):
    """`[run.hf]`: the Hugging Face model a run of `participant.tasks.hf` trains, and how. The model's config and
    tokenizer (and, for adapters, the frozen base's weights) are recorded by digest: every participant checks that it
    holds the same ones before it joins, and every update names them (`fed.model`), so ingest refuses one trained
    from anything else."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field("", description="The model every participant loads: a local directory (config.json, the "
                       "tokenizer, safetensors weights) or a hub id already in the host's cache (nothing is "
                       "downloaded). A host whose copy lives elsewhere sets FED_HF_MODEL.")
    config_digest: str = Field("", pattern=DIGEST_PATTERN, description="SHA-256 of the model's config (canonical "
                               "JSON, `participant.tasks.hf.model_digests`); '': not checked.")
    tokenizer_digest: str = Field("", pattern=DIGEST_PATTERN, description="SHA-256 of the tokenizer's canonical "
                                  "JSON; '': not checked.")
    base_digest: str = Field("", pattern=DIGEST_PATTERN, description="With adapters: SHA-256 of the frozen base "
                             "model's weights (never uploaded); '': not checked.")
    text: tuple[str, ...] = Field((), description="Training text in assigned mode, the same files on every host "
                                  "(plain text, or JSON lines with text_field; with the datasets extra also a "
                                  "save_to_disk directory, DIR@SPLIT for a DatasetDict's split (default train), or "
                                  "Parquet files, their text_field column); (): Python's own help text.")
    text_field: str = Field("text", description="The field of a JSON-lines record, or the column of a dataset or "
                            "Parquet file, that holds its text.")
    sequence_length: int = Field(128, ge=8, le=1 << 20, description="Tokens per packed training sequence.")
    tokens_per_step: int = Field(0, ge=0, description="Tokens an optimizer step sees: gradients of that many "
                                 "tokens' micro-batches (batch_size sequences each) are accumulated; 0: one batch.")
    warmup_rounds: int = Field(0, ge=0, description="Rounds over which the learning rate rises linearly from a "
                               "tenth to learning_rate, before a cosine decay to a tenth at total_rounds.")
    eval_sequences: int = Field(64, ge=0, description="Held-out sequences evaluated (evenly spaced); 0: all.")
    adapter: Adapter = Field(Adapter.NONE, description="none: full fine-tuning; lora: low-rank adapters only.")
    lora_rank: int = Field(8, ge=1, le=1024, description="LoRA rank r.")
    lora_alpha: int = Field(16, ge=1, description="LoRA scale numerator (the update is scaled by alpha / r).")
    lora_targets: tuple[str, ...] = Field(("q_proj", "v_proj"), min_length=1, description="Module names the "
                                          "adapters wrap (PEFT's target_modules).")

    def identity(self) -> dict[str, str]:
        """What every update must name (its `fed.model` metadata): the recorded digests of the config, the
        tokenizer and, with adapters, the base; empty ones are not checked."""
        named = {"config": self.config_digest, "tokenizer": self.tokenizer_digest,
                 "base": self.base_digest if self.adapter is Adapter.LORA else ""}
        return {part: value for part, value in named.items() if value}


class RunConfig(BaseModel):
    """What a run is: who may join, how rounds are paced, how updates are combined and checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = Field(description="Lower-case letters, digits and '-', 3-40 characters, without '-p-' and not "
                        "ending in '-p' (participant queues are fed-<run>-p-<id>); part of every name.")
    min_clients: int = Field(2, ge=1, description="Participants needed to start an epoch.")
    fraction_per_round: float = Field(1.0, gt=0.0, le=1.0, description="Share of members trained per round.")
    min_per_round: int = Field(1, ge=1, description="Participants selected per round at least.")
    min_updates: int = Field(1, ge=1, description="Accepted updates a round needs to be aggregated.")
    total_rounds: int = Field(10, ge=1, description="Aggregated rounds before the run is Finished.")
    rounds_per_epoch: int = Field(0, ge=0, description="Rounds per epoch; 0 means one epoch for the run.")
    warmup_time: float = Field(30.0, ge=0, description="Seconds for members to fetch the model.")
    max_round_train_time: float = Field(300.0, gt=0, description="Round deadline in seconds.")
    round_witness_time: float = Field(
        30.0, ge=0, description="Seconds the witness phase waits for missing proofs at most; it ends at once when "
        "every elected witness's proof is in, or a quorum of them attest the same updates."
    )
    cooldown_time: float = Field(5.0, ge=0, description="Seconds between epochs.")
    liveness_timeout: float = Field(60.0, gt=0, description="Silence after which a participant is dropped.")
    heartbeat_interval: float = Field(
        0.0, ge=0, description="Seconds between heartbeats; 0: liveness_timeout / 3. A heartbeat due within this long "
        "of an update upload is skipped (ingesting the update showed the participant alive).")
    epoch_time: float = Field(0.0, ge=0, description="Seconds after which an epoch ends at its next round; 0: off.")
    witness_nodes: int = Field(0, ge=0, description="Witnesses elected per round; 0 turns witnessing off.")
    witness_tolerance: float = Field(
        0.1, ge=0, description="A witness attests update i if the round's aggregate is at most (1 + this) x worse "
        "on its held-out data with i than without it (leave-one-out)."
    )
    health_strikes: int = Field(
        2, ge=1, description="Witnessed rounds in a row a member's update must go unattested by a quorum of "
        "witnesses before a health report drops it; 1: the first. Two spare an honest member one unlucky round "
        "(its update is left out of that round either way) at the cost of a poisoner's seat for one more round."
    )
    witness_strikes: int = Field(
        1, ge=1, description="Refused witness proofs (over-full, empty against the round's records, or refusing an "
        "update a quorum of the other witnesses attested) that drop their witness; its seats are drawn again "
        "from the round's seed, and the round is witnessed by the others, not given up."
    )
    witness_min_cosine: float = Field(
        -0.7, ge=-1, le=1, description="A witness attests update i only if the cosine between its change and the "
        "coordinate-wise median of the round's other changes is at least this (with two others or more; with two, "
        "the median of all three); -1: off."
    )
    norm_outlier_factor: float = Field(
        10.0, ge=0, description="Refuse an update whose distance from the global is this x the round's median; 0: off."
    )
    checkpoint_every: int = Field(
        5, ge=0, description="Aggregated rounds between checkpoints (one is also written at each epoch's end); "
        "0: at epoch ends only. `fed run restore` rebuilds a run that lost its table from the latest."
    )
    max_sample_ratio: float = Field(
        4.0, ge=0, description="Refuse an update claiming more than this x the median sample count of the "
        "round's other updates (so no claim can own FedAvg); 0: off. With dataset_size set, claims are also "
        "bounded by the assigned share."
    )
    max_clock_skew: float = Field(
        300.0, gt=0, description="Seconds a join request or heartbeat may be sent before (or, clocks being "
        "clocks, after) it arrives; older copies are refused as replays."
    )
    max_participants: int = Field(1000, ge=1, description="Participants that may join the run at most.")
    upload_budget: int = Field(
        1000, ge=1, description="Objects one participant may upload in a minute (UPLOAD_WINDOW_SECONDS, by the "
        "time S3 stamps on the event), counted at ingest before anything reads the object; past it an object is "
        "dropped and counted, not recorded nor ticked on. An honest participant's objects are its update per round "
        "(and the retries of it), a witness proof and a health report per round, and a heartbeat every "
        "heartbeat_interval: at the fastest rounds measured (about 0.2 s, `make bench-rounds`) about 300 a minute.")
    start_grace: float = Field(
        10.0, ge=0, description="Seconds the run, waiting for members, holds an epoch's start for live joiners not "
        "yet heard from since their join, counted from when the min_clients-th participant it would admit joined: "
        "a fleet launched together starts together, not with whoever's first heartbeat was ingested first. It "
        "starts at once when every live joiner was heard from. 0: start as soon as min_clients were."
    )
    max_admissions_per_epoch: int = Field(
        100, ge=1, description="New members an epoch admits at most (members of the epoch before it are not "
        "counted): live joiners heard from since their join, earliest joined first, ties by id. At least "
        "min_clients. Bounds how many identities a burst of joins can bring into one epoch."
    )
    strategy: Strategy = Field(Strategy("meamed"), description="How a round's counted updates are combined: "
                               + ", ".join(STRATEGIES) + " (`shared.strategies`). meamed (the default): each "
                               "element the mean of the majority of values nearest its median, unweighted, so no "
                               "claimed sample count or speed buys weight and fewer than half of the updates cannot "
                               "steer it; fedavg weighs by claimed samples (bounded by max_sample_ratio).")
    trim_fraction: float = Field(0.2, ge=0, lt=0.5, description="Share trimmed at each end (trimmed_mean).")
    clip_norm: float = Field(0.0, ge=0, description="Update-delta norm bound (clipped_fedavg); 0: median.")
    krum_byzantine: int = Field(
        1, ge=0, description="krum: the Byzantine updates a round tolerates at most (f). Each update is scored by its "
        "squared distances to its n - f - 2 nearest others; a round of fewer than 2f + 3 updates cannot tell them "
        "apart and is combined by FedAvg instead (its global's header says so, `fed.krum`): set min_updates to at "
        "least 2f + 3.")
    krum_selected: int = Field(0, ge=0, description="krum: how many updates of lowest score are averaged (m, "
                               "weighted by samples); 0: n - f (multi-Krum), 1: Krum's single update; at most n - f.")
    server_optimizer: ServerOptimizer = Field(
        ServerOptimizer("none"), description="Applied to the round's pseudo-gradient (global - the strategy's "
        "aggregate): none (the aggregate is the next global), fedavgm, fedadam, fedyogi or diloco. Its state "
        "(momentum, moments) is kept in the bucket beside the global model, in the same pieces.")
    server_lr: float = Field(0.0, ge=0, description="Server learning rate; 0: the optimizer's default (fedavgm "
                             "1.0, fedadam and fedyogi 0.1, diloco 0.7).")
    server_momentum: float = Field(0.9, ge=0, lt=1, description="fedavgm and diloco momentum; fedadam and "
                                   "fedyogi beta1.")
    server_beta2: float = Field(0.99, ge=0, lt=1, description="fedadam and fedyogi second-moment decay.")
    server_tau: float = Field(1e-3, gt=0, description="fedadam and fedyogi adaptivity (added to sqrt(v)).")
    task: str = Field("participant.tasks.digits:task", description="module:object of the training task.")
    initial_model_schema: str = Field(
        "", pattern=DIGEST_PATTERN, description="The tensors (names, dtypes, shapes) an initial-model offer "
        "must hold, named by the content digest (shared.digest) of their canonical safetensors header without "
        "metadata (shared.wire.encode_header); a built-in task's meta module gives its own (e.g. participant.tasks."
        "digits_meta.MODEL_SCHEMA), and a refused offer's reason names the schema it had. Ingest refuses any other "
        "offer, so no participant can make round 0's global a model the task cannot load; '': the task's own "
        "where it is a built-in one (shared.initial_models), any well-formed model otherwise.")
    initial_model_digest: str = Field(
        "", pattern=DIGEST_PATTERN, description="The content digest (shared.digest) of the one initial model "
        "the run may start from; ingest refuses every other offer. Pins the initial weights, not only their shapes "
        "(initial_model_schema); '': any offer that fits initial_model_schema.")
    hf: HfOptions = Field(default_factory=HfOptions, description="[run.hf]: the Hugging Face task's model, "
                          "text and adapters (participant.tasks.hf).")
    data_mode: DataMode = Field(
        DataMode.ASSIGNED, description="assigned: every host holds the same training set and trains the slices "
        "each round assigns it; local: each trains on its own data (`fed-participant start --data`), registering "
        "its sample count at join, and an update claiming more samples than registered is refused.")
    dataset_size: int = Field(0, ge=0, description="Samples in the shared training set; 0: from the task.")
    local_epochs: int = Field(1, ge=1, description="Passes over its data per round (unless local_steps is set).")
    local_steps: int = Field(
        0, ge=0, description="Optimizer steps each participant takes per round (DiLoCo's H inner steps), cycling "
        "through its data in fresh seeded orders as often as needed; 0: local_epochs passes instead.")
    batch_size: int = Field(32, ge=1)
    learning_rate: float = Field(0.05, gt=0)
    update_encoding: UpdateEncoding = Field(
        UpdateEncoding.WEIGHTS, description="What participants upload: weights (the trained weights, in the "
        "model's dtypes), bf16 (the delta from the round's global model as bfloat16: half of float32's bytes) or "
        "int8 (the delta quantized per block of quant_block elements, one float32 scale each: about a quarter) or "
        "topk (of each chunk of topk_chunk elements, the topk_percent % largest in magnitude, as positions and "
        "topk_bits-bit values: about 1/87 of float32 at 2 % and 2 bits, 1/78 at 4 bits; what is not sent is kept "
        "by error feedback). The coordinator decodes as it reads; the global model stays in the model's dtypes.")
    quant_block: int = Field(256, ge=1, le=1 << 20, description="Elements per int8 quantization block (one "
                             "float32 scale each).")
    topk_percent: float = Field(2.0, gt=0, le=100, description="topk: the share of each chunk sent, in percent "
                                "(rounded up to whole entries; SparseLoCo sends 1-3 %).")
    topk_bits: int = Field(2, description="topk: bits per sent value, 2 or 4 (one float32 step per chunk).")
    topk_chunk: int = Field(4096, ge=1, le=1 << 15, description="topk: elements per chunk (positions are 16-bit).")
    download_encoding: DownloadEncoding = Field(
        DownloadEncoding.FULL, description="What participants download each round: full (the global model) or the "
        "round's change from the previous global as bf16, int8 (per block of quant_block elements) or topk (the "
        "topk_percent % largest of each chunk of topk_chunk float elements at topk_bits bits, as for updates; what "
        "is not sent is kept by the coordinator as error feedback, in the server optimizer state, and sent in later "
        "rounds), which a participant holding the previous global applies; the global model is then defined as the "
        "previous one plus the decoded change, so it is exact and verifiable. A participant without the previous "
        "one downloads the full model.")
    fragments: int = Field(
        1, ge=1, le=64, description="Streaming DiLoCo: the model's tensors are split into this many fragments "
        "(strided across layers, `shared.fragments`) and round r syncs fragment r mod F alone, so each sync moves "
        "about 1/F of the model; 1: every round syncs the whole model. Needs a delta update_encoding.")
    fragment_mix: float = Field(
        0.5, ge=0, le=1, description="Streaming DiLoCo: a participant's local values of a synced fragment become "
        "this x its own + (1 - this) x the new global's (the paper's mixing factor alpha; 0: the global's).")
    fragment_overlap: int = Field(
        0, ge=0, description="Streaming DiLoCo: inner steps a participant trains its own model on after uploading "
        "its fragment, while the round aggregates (the paper's tau; the round's new global is mixed in after them). "
        "They count toward the next round's local_steps; cut short when the next round starts first. 0: none.")
    error_feedback: bool = Field(True, description="Participants keep what quantization lost and add it to their "
                                 "next round's delta (bf16, int8), so no part of an update is lost for good.")
    max_update_bytes: int = Field(
        16 * 1024**3, gt=0, description="Largest update object accepted (ingest streams it: memory does not grow "
        "with it; see docs/deploy.md for the functions' memory).")
    shard_bytes: int = Field(
        512 * 1024**2, ge=8 * 1024**2, description="Aggregation shard size: a global model of S bytes is "
        "aggregated by ceil(S / shard_bytes) workers in parallel, each over its own byte range (multiples of "
        "the 8 MiB digest piece).")
    seed: int = Field(0, ge=0, description="Run seed for selection and data assignment.")
    work_sizing: WorkSizing = Field(
        WorkSizing.THROUGHPUT, description="throughput: each selected participant's share of a round (its slice of "
        "the data, or its local steps) is proportional to its measured training throughput, so all are predicted "
        "to finish together; equal: equal shares.")
    throughput_smoothing: float = Field(0.5, gt=0, le=1, description="Weight of the newest round in a participant's "
                                        "smoothed throughput estimate.")
    max_speed_ratio: float = Field(8.0, ge=1, description="Throughput estimates are clamped to [median / this, "
                                   "median x this] of the round's participants: no reported rate buys more.")
    max_share_ratio: float = Field(
        2.0, ge=1, description="No participant is sized above this x the round's median share (its slice of the data, "
        "and with it its FedAvg weight), however fast it reports itself: a reported speed cannot buy the round. "
        "Raise it for fleets whose hosts differ more, knowing a member can then claim that much.")
    deadline_margin: float = Field(
        3.0, ge=0, description="The round's deadline is the latest predicted finish (from the throughput "
        "estimates) x this, within [min_round_train_time, max_round_train_time]; 0: always max_round_train_time.")
    min_round_train_time: float = Field(60.0, ge=0, description="The shortest deadline a prediction may set.")
    stuck_timeout: float = Field(
        120.0, ge=0, description="A selected participant that heartbeats but whose training progress has not moved "
        "for this many seconds is stuck: the round does not wait for it, and it is dropped when the round closes; "
        "0: off.")

    @field_validator("run_id")
    @classmethod
    def _run_id_shape(cls, value: str) -> str:
        if not RUN_ID_PATTERN.fullmatch(value):
            raise ValueError("must be 3-40 characters of a-z, 0-9 and '-', starting and ending alphanumeric")
        if PARTICIPANT_QUEUE_MARK in f"{value}-":
            raise ValueError(f"must not contain '{PARTICIPANT_QUEUE_MARK}' or end with '-p': "
                             f"participant queues are named fed-<run>{PARTICIPANT_QUEUE_MARK}<participant>, and "
                             "such a run's queues could be another run's participant queues (whose participants "
                             "may create and delete them)")
        return value

    @model_validator(mode="before")
    @classmethod
    def _task_schema(cls, data: Any) -> Any:
        """A run file that pins no initial model gets its built-in task's schema (`shared.initial_models`): the
        model round 0 starts from is then the task's, not whoever's offer was ingested first."""
        if isinstance(data, dict) and not data.get("initial_model_schema") and not data.get("initial_model_digest"):
            task = data.get("task", cls.model_fields["task"].default)
            if isinstance(task, str) and (schema := task_model_schema(task)):
                data = {**data, "initial_model_schema": schema}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.min_per_round > self.min_clients:
            raise ValueError(
                f"min_per_round ({self.min_per_round}) cannot exceed min_clients ({self.min_clients})"
            )
        if self.min_updates > self.min_per_round:
            raise ValueError(f"min_updates ({self.min_updates}) cannot exceed min_per_round ({self.min_per_round})")
        if self.max_admissions_per_epoch < self.min_clients:
            raise ValueError(f"max_admissions_per_epoch ({self.max_admissions_per_epoch}) cannot be below "
                             f"min_clients ({self.min_clients}): the first epoch could never start")
        STRATEGIES[self.strategy](self)  # the strategy takes its parameters, or refuses them (ValueError)
        if self.topk_bits not in TOPK_BITS:
            raise ValueError(f"topk_bits must be one of {', '.join(map(str, TOPK_BITS))}, got {self.topk_bits}")
        if self.fragments > 1 and self.update_encoding is UpdateEncoding.WEIGHTS:
            raise ValueError(f"fragments = {self.fragments} needs a delta update_encoding (bf16, int8 or topk): a "
                             "fragment's update is its delta from the global, the other tensors' (zero) left out")
        if self.fragments > 1 and self.download_encoding is DownloadEncoding.TOPK:
            raise ValueError(f"download_encoding topk with fragments = {self.fragments}: the coordinator's error "
                             "feedback would go on changing, in every round, tensors the round does not sync; use "
                             "full, bf16 or int8 downloads with fragments")
        if self.fragment_overlap and (self.fragments < 2 or self.fragment_overlap >= self.local_steps):
            raise ValueError(f"fragment_overlap ({self.fragment_overlap}) needs fragments > 1 and fewer steps than "
                             f"local_steps ({self.local_steps}): its steps are the next round's first")
        if self.update_encoding is UpdateEncoding.TOPK and self.witness_nodes:
            raise ValueError("update_encoding topk cannot be witnessed (witness_nodes = 0, or int8 updates): a witness "
                             "judges one update by the round's aggregate with and without it, and a topk update "
                             "releases several rounds of error feedback at once, so an honest one can raise that loss "
                             "far past the tolerance (x2.4 in 2 of 10 rounds of a 3-member digits demo, and the health "
                             "check dropped the member)")
        if self.update_encoding is UpdateEncoding.TOPK and not self.error_feedback:
            raise ValueError("update_encoding topk needs error_feedback: without it, what each round does not send "
                             f"(about {100 - self.topk_percent:g} % of every delta) is lost for good")
        return self

    @property
    def server_step(self) -> float:
        """The server learning rate in use."""
        return self.server_lr or OPTIMIZERS[self.server_optimizer].default_lr

    @property
    def encoding(self) -> Encoding:
        if self.update_encoding is UpdateEncoding.TOPK:
            return Encoding.topk(self.topk_percent, self.topk_bits, self.topk_chunk)
        return Encoding(self.update_encoding.value, self.quant_block)

    @property
    def download(self) -> Encoding:
        """The download delta's encoding (`weights`: full models only)."""
        kind = self.download_encoding.value
        if self.download_encoding is DownloadEncoding.TOPK:
            return Encoding.topk(self.topk_percent, self.topk_bits, self.topk_chunk)
        return Encoding("weights" if kind == "full" else kind, self.quant_block)

    @property
    def epoch_rounds(self) -> int:
        return self.rounds_per_epoch or self.total_rounds

    @property
    def heartbeat_every(self) -> float:
        return self.heartbeat_interval or self.liveness_timeout / 3

    @property
    def heartbeat_after_update(self) -> float:
        """How long an update upload stands in for a heartbeat: two intervals (by default two thirds of the
        liveness timeout), always leaving one interval before the timeout for the heartbeat that follows. The update
        is in the bucket once its upload returned, and a tick looks there before it drops anyone as silent
        (`coordinator.catchup`): so a member uploading every round sends no heartbeat while its rounds are shorter
        than this, one interval less than a heartbeat needs for itself."""
        every = self.heartbeat_every
        return max(every, min(2 * every, self.liveness_timeout - every))

    def to_json_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def parse_config(data: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate a config mapping; errors name every offending field in one message."""
    table = data.get("run", data)
    try:
        return RunConfig.model_validate(table)
    except ValidationError as exc:
        raise ConfigError(describe(exc, f"{source}: invalid run configuration")) from None


def describe(exc: ValidationError, heading: str, prefix: str = "") -> str:
    """One message naming every offending field of a validation error."""
    lines = [heading]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top)"
        lines.append(f"  {prefix}{where}: {err['msg']}")
    return "\n".join(lines)


def load_config(path: str | Path) -> RunConfig:
    """Read a run TOML file (keys at top level or under [run])."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such run configuration file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_config(data, str(path))
