"""Contrastive pre-training with HuggingFace Accelerate, identical on 1 or N processes.

    accelerate launch trainer.py                                    # one process, digits
    accelerate launch --config_file accelerate_configs/cpu_2_processes.yaml trainer.py
    accelerate launch trainer.py --config run.yaml --lr 0.1         # a file, a flag overriding it
    from trainer import TrainConfig, train                          # inside your own pipeline

``--batch-size`` is the *global* batch: the same command line trains the same
model on any number of processes (see README for the measured tolerances). The
method (model, data items, embedding, loss, state) is ``contrastive_accelerate.methods``;
this file is the loop: options, ``train()``, the loop, ``main()``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from contrastive_accelerate.checkpoint import CheckpointError, RunState, resume
from contrastive_accelerate.checkpoint_shards import ShardError
from contrastive_accelerate.compat import forget_prepared, prepared_count
from contrastive_accelerate.config import parse_args, resume_rules
from contrastive_accelerate.data import (
    BadRow,
    UnreadableImage,
    batches_per_epoch,
    described,
    train_loader,
    workers_stopped_on_exit,
)
from contrastive_accelerate.figures import baselines_and_probe, final_summary
from contrastive_accelerate.grad_cache import cached_backward
from contrastive_accelerate.knn import KnnData, evaluated_images, knn_data, knn_top1
from contrastive_accelerate.launch import make_accelerator, one_line_errors
from contrastive_accelerate.methods import METHODS, Method
from contrastive_accelerate.optim import make_optimizer, warmup_cosine
from contrastive_accelerate.options import TrainConfig, check_data, check_launch, check_steps
from contrastive_accelerate.preemption import StopSignals, exit_preempted
from contrastive_accelerate.ranks import (
    StepChecks,
    any_rank,
    on_main_process,
    raise_together,
    total_over_ranks,
)
from contrastive_accelerate.run_directory import RunDirectory
from contrastive_accelerate.sharding import is_sharded, reshard_after_evaluation


@dataclass
class TrainResult:
    """What a pipeline needs after ``train``."""

    #: Unwrapped, trained, on the accelerator's device; under --fsdp sharded still
    #: (``contrastive_accelerate.sharding.consolidated`` makes a plain copy).
    model: torch.nn.Module
    metrics: dict[str, float]
    step: int
    final_model_dir: str | None  # None when preempted before the final save
    last_checkpoint: str | None  # the newest checkpoint this run wrote
    preempted: str | None  # the signal that stopped the run after a checkpoint, if any


def train(config: TrainConfig, accelerator: Accelerator | None = None) -> TrainResult:
    """Train as ``config`` says.

    ``accelerator``: pass yours to train inside your own pipeline; its mixed precision
    and trackers apply, and ``train`` leaves its trackers and process group alone, so
    you can call ``train`` again or run collectives of your own afterwards. ``None``:
    one is made from ``config`` (``--report-to``, ``--collective-timeout``).
    """
    config = config.resolved()  # the output directory too: runs/<method> unless given
    own_accelerator = accelerator is None
    if own_accelerator:
        accelerator = make_accelerator(
            config.output_dir, config.report_to, config.collective_timeout
        )
    check_launch(config, accelerator, own_accelerator)
    # The output directory belongs to one run at a time (a lock the OS drops on exit).
    run = RunDirectory(config.output_dir, keep=config.save_total_limit)
    resume_path = on_main_process(
        run.claim, config.resume_from, config.overwrite_output_dir, errors=(CheckpointError,)
    )
    prepared = prepared_count(accelerator)
    # Signals are honoured from here to the last write: one that comes before the first
    # step stops the run there, where nothing has been trained to lose.
    try:
        with StopSignals() as signals:
            return _train(config, accelerator, run, resume_path, own_accelerator, signals)
    finally:
        run.release()
        if own_accelerator:
            for tracker in accelerator.trackers:
                tracker.finish()
        # A pipeline calling train() again must not keep this run's model alive.
        forget_prepared(accelerator, prepared)


def _train(
    config: TrainConfig,
    accelerator: Accelerator,
    run: RunDirectory,
    resume_path: str | None,
    own_accelerator: bool,
    signals: StopSignals,
) -> TrainResult:
    """The run itself, top to bottom: data, method, optimizer, resume, loop, save."""
    # Data: the global batch and each sample's randomness depend on (seed, epoch, index).
    data = METHODS[config.method].load(config)
    evaluated, evaluation_source = evaluated_images(config, data)  # --eval-dataset's, or its own
    accelerator.print(evaluation_source)
    check_data(config, data)
    if config.streaming or config.mixed:  # no epochs: read once, for --max-steps
        steps_per_epoch = config.max_steps
    else:
        steps_per_epoch = batches_per_epoch(len(data.train), config.batch_size, config.drop_last)
    total_steps = config.max_steps or config.epochs * steps_per_epoch

    # Method and optimizer
    set_seed(config.seed)  # identical initial weights on every rank
    method = METHODS[config.method].build(
        config,
        data,
        accelerator.num_processes,
        accelerator.print,
        total_steps=total_steps,
        device=accelerator.device,
    )
    if config.augmentation_seeding == "per-process":
        set_seed(config.seed, device_specific=True)  # the common practice: seed + rank
    model, optimizer = _distributed(config, accelerator, method)

    # Resume: model, optimizer and method state; the step gives the data position and the lr.
    samples, data_inputs = described(data.train)
    state = RunState(dataclasses.asdict(config), samples, accelerator.num_processes,
                     {**method.inputs, **data_inputs})  # fmt: skip
    step = _resume(accelerator, model, optimizer, method, resume_path, state) if resume_path else 0
    check_steps(step, total_steps)
    if accelerator.is_main_process:
        run.log({"start_step": step, "cpu_threads": torch.get_num_threads(),
                 **dataclasses.asdict(state)})  # fmt: skip
    if own_accelerator:
        accelerator.init_trackers(config.method, config=_flat_for_trackers(config))
    # Every rank evaluates its share of the kNN bank and queries (contrastive_accelerate.knn).
    knn = None
    if evaluated.evaluation is not None and evaluated.image_column is not None:
        knn = knn_data(evaluated.train, evaluated.evaluation, evaluated.image_column,
                       evaluated.label_column, config.image_size,
                       config.skip_bad_images)  # fmt: skip
    training = _Training(config, accelerator, run, method, model, optimizer, state, signals, knn,
                         StepChecks(accelerator.device), steps_per_epoch, total_steps)  # fmt: skip
    progress = _Progress(step, saved_step=step, started_step=step)
    if step == 0 and knn is not None:
        progress.metrics["knn_top1_init"] = training.evaluate(step)

    # Loop, then save and evaluate
    _loop(training, progress)
    if not progress.preempted:
        _finish(training, progress)
    # Not the compiled wrapper (--dynamo_backend): its forward still holds the DDP replica,
    # whose reducer would outlive the process group, which gloo aborts on at exit.
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    if progress.preempted:
        accelerator.print(f"stopped by {progress.preempted} {progress.where(resume_path)}; "
                          "continue with --resume-from latest")  # fmt: skip
    elif accelerator.is_main_process:
        print(final_summary(progress.metrics, config.knn_k, progress.final, knn), flush=True)
    return TrainResult(unwrapped, progress.metrics, progress.step, progress.final,
                       progress.last_checkpoint, progress.preempted)  # fmt: skip


@dataclass
class _Training:
    """What the loop, the saves and the evaluations work on, as ``_train`` built it."""

    config: TrainConfig
    accelerator: Accelerator
    run: RunDirectory
    method: Method
    model: torch.nn.Module  # DDP-wrapped, or sharded in place (--fsdp)
    optimizer: torch.optim.Optimizer
    state: RunState
    signals: StopSignals
    knn: KnnData | None
    #: Non-finite losses and problems found without a collective: raised at logging and saving.
    checks: StepChecks
    steps_per_epoch: int
    total_steps: int

    def save(self, step: int) -> str:
        """A checkpoint, written by the main process (every rank holds the same states),
        or under --fsdp by every rank, each its shards."""
        self.checks.raise_if_any()  # never a checkpoint of a model a non-finite loss trained
        states = (self.optimizer, self.state, self.method.state_dict())
        if is_sharded(self.model):
            return self.run.save_checkpoint(step, self.model, *states)
        model = self.accelerator.unwrap_model(self.model)
        return on_main_process(self.run.save_checkpoint, step, model, *states,
                               errors=(CheckpointError,))  # fmt: skip

    def save_final(self) -> str:
        """``final/``, written by the main process, or under --fsdp by every rank (one
        tower whole at a time)."""
        if is_sharded(self.model):
            return self.run.save_final(self.model, self.method.state_dict())
        model = self.accelerator.unwrap_model(self.model)
        return on_main_process(self.run.save_final, model, self.method.state_dict(),
                               errors=(CheckpointError,))  # fmt: skip

    def evaluate(self, step: int) -> float:
        """kNN top-1 of the encoder that evaluation sees: the student's, or the teacher's
        (--eval-teacher); under --fsdp sharded, every rank running the same forwards."""
        encoder = self.method.evaluated_encoder()
        encoder.eval()
        accuracy = knn_top1(encoder, self.knn, k=self.config.knn_k)
        encoder.train()
        reshard_after_evaluation(encoder)
        self.log({"knn_top1": accuracy}, step)
        return accuracy

    def log(self, record: dict, step: int) -> None:
        """``record`` to the trackers and metrics.jsonl."""
        self.accelerator.log(record, step=step)
        if self.accelerator.is_main_process:
            self.run.log({"step": step, **record})


@dataclass
class _Progress:
    """Where the run is: its step, its checkpoints, its figures and what stopped it."""

    step: int
    saved_step: int  # the step of the last checkpoint, or where the run started
    started_step: int
    last_checkpoint: str | None = None  # the newest checkpoint this run wrote
    final: str | None = None
    preempted: str | None = None  # the signal that stopped the run, once agreed
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    skipped_samples: int = 0  # by this run, on all ranks (--skip-bad-images, --skip-bad-rows)

    def stop(self, training: _Training) -> None:
        """A stop agreed at this step: the checkpoint of the step, written now unless it
        was just saved."""
        if self.step != self.saved_step:
            self.last_checkpoint = training.save(self.step)
        self.preempted = training.signals.requested or "a signal to another rank"

    def where(self, resume_path: str | None) -> str:
        """Where a stopped run stands, for its last line."""
        if self.last_checkpoint is None and self.step == self.started_step:
            latest = f"{resume_path} is still the latest" if resume_path else "none written"
            return f"before step {self.step + 1}, nothing trained: checkpoint {latest}"
        trained = (
            f" ({self.final} holds the trained model, not yet evaluated)" if self.final else ""
        )
        return f"at step {self.step}{trained}: checkpoint " + (
            self.last_checkpoint or "of this step already saved"
        )


def _loop(training: _Training, progress: _Progress) -> None:
    """Train from ``progress.step`` to the last step, or to a stop that the ranks agree
    where they meet (each step's start, the final save, each evaluation): a checkpoint
    of that step is written before the exit. The bar ends its line before any error;
    the workers stop whatever ends the loop."""
    config, accelerator, method = training.config, training.accelerator, training.method
    loader, sampler = train_loader(
        method.dataset,
        accelerator,
        batch_size=config.batch_size,
        seed=config.seed,
        drop_last=config.drop_last,
        num_workers=config.num_workers,
        padded_batches=config.data_sharding == "accelerate",
        duplicate_keys=method.duplicate_keys(),
        per_rank_streams=config.stream_split == "per-rank",
    )
    learning_rate = warmup_cosine(config.lr, config.warmup_steps, training.total_steps)
    bar = tqdm(total=training.total_steps, initial=progress.step, desc="training",
               disable=not accelerator.is_main_process, dynamic_ncols=True)  # fmt: skip
    started = time.perf_counter()
    with bar, workers_stopped_on_exit(loader):
        while progress.step < training.total_steps and not progress.preempted:
            epoch, first_batch = divmod(progress.step, training.steps_per_epoch)
            sampler.set_epoch(epoch, first_batch)
            for batch in loader:
                stop, skipped = _stop_requested(training.signals, batch, config)
                progress.skipped_samples += skipped
                if stop:
                    progress.stop(training)
                    break
                step = progress.step
                # Every rank's share, known from the sampler: the losses exchange nothing
                # (unless a rank skipped an image, or Accelerate shards: the control).
                sizes = None
                if not skipped and config.data_sharding != "accelerate":
                    sizes = sampler.share_sizes(step % training.steps_per_epoch)
                    sizes = training.checks.known_sizes(sizes)
                lr = learning_rate(step)
                loss = train_step(training.model, training.optimizer, method, batch,
                                  step=step, epoch=epoch, lr=lr, sizes=sizes,
                                  chunks=config.accumulation_chunks,
                                  backward=accelerator.backward)  # fmt: skip
                training.checks.record(step, loss)
                progress.step = step = step + 1
                bar.update(1)
                if step % config.log_every == 0 or step == training.total_steps:
                    training.checks.raise_if_any()
                    speed = (step - progress.started_step) * config.batch_size
                    counts = sampler.steps_per_source(step) if config.mixed else {}
                    figures = _log(training, bar, step, loss, lr, epoch,
                                   speed / (time.perf_counter() - started),
                                   counts, progress.skipped_samples)  # fmt: skip
                    progress.metrics |= figures
                _save_and_evaluate(training, progress)
                if step == training.total_steps:
                    break


def _save_and_evaluate(training: _Training, progress: _Progress) -> None:
    """The checkpoint (--save-every) and the evaluations (--eval-every) due after a step."""
    config, step = training.config, progress.step
    if config.save_every and step % config.save_every == 0:
        progress.last_checkpoint, progress.saved_step = training.save(step), step
    due = config.eval_every and step % config.eval_every == 0 and step < training.total_steps
    if due and training.knn is not None:
        training.evaluate(step)
    if due:  # retrieval, BEIR, zero-shot: what a pairs run measures while it trains
        _method_figures(training, step)


def _finish(training: _Training, progress: _Progress) -> None:
    """Save, then evaluate: a failing evaluation never loses the trained model, and a
    signal during either leaves a checkpoint of the last step to finish from. Under
    --fsdp the model stays sharded: every rank takes part in the final save (one tower
    whole at a time) and in each evaluation's forwards."""
    progress.final = training.save_final()
    evaluations = [partial(_method_figures, training, progress.step)]
    if training.knn is not None:
        evaluations[:0] = [
            lambda: {"knn_top1": training.evaluate(progress.step)},
            partial(_baselines_and_probe, training, progress.step),
        ]
    for evaluate in evaluations:
        if any_rank(training.signals.requested is not None)[0]:
            progress.stop(training)
            return
        progress.metrics |= evaluate()


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    method: Method,
    batch: Any,
    *,
    step: int,
    epoch: int,
    lr: float,
    sizes: list[int] | None = None,
    chunks: int = 1,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
) -> torch.Tensor:
    """One optimisation step on ``batch``, this rank's share of the global batch.

    The method embeds the share (``method.embed``) and computes this rank's part of the
    global loss over every rank's embeddings (``method.loss``, told every rank's share
    ``sizes`` where the loop knows them); its gradients come in ``chunks`` of the share
    that give the one-chunk gradients exactly (``grad_cache.cached_backward``; the
    accelerator's ``backward`` for mixed precision). Then the step at ``lr``, between
    the method's hooks (a teacher's EMA, a queue, a frozen head's gradients). Returns the
    loss, detached from nothing: the loop reads it at logging steps only.
    """
    loss = cached_backward(
        model,
        batch.split(chunks),
        partial(method.loss, batch=batch, sizes=sizes, step=step),
        forward=partial(method.embed, model, step=step),
        backward=backward,
    )
    for group in optimizer.param_groups:
        group["lr"] = lr
    method.before_optimizer_step(epoch, step)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    method.after_step(step)
    return loss


def _distributed(
    config: TrainConfig, accelerator: Accelerator, method: Method
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer as every rank trains them: with ``--fsdp`` weights,
    gradients and optimizer state sharded in place (FSDP2), else replicas under DDP.
    The one place that decides: the saves and evaluations ask ``is_sharded(model)``."""
    if config.fsdp:
        method.shard(accelerator.mixed_precision)  # before the optimizer sees the weights
    optimizer = make_optimizer(
        config.optimizer,
        method.model.parameters(),
        lr=config.lr,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
    )
    if config.fsdp:
        return method.model, accelerator.prepare(optimizer)
    return accelerator.prepare(method.model, optimizer)


def _stop_requested(signals: StopSignals, batch, config: TrainConfig) -> tuple[bool, int]:
    """Whether any rank was signalled to stop, and how many samples the ranks skipped
    (a rank's share is then smaller than the sampler's). One exchange per step, before
    any other collective of the step, on the host, also says whether any rank drew an
    unreadable image or a stream's unusable row: an error on every rank, or skipped, said
    by its rank and counted on every rank, with ``--skip-bad-images`` or
    ``--skip-bad-rows``."""
    skip = {UnreadableImage: config.skip_bad_images, BadRow: config.skip_bad_rows}
    flags = {UnreadableImage: "--skip-bad-images", BadRow: "--skip-bad-rows"}
    broken = [error for error in batch.unreadable if not skip[type(error)]]
    stop, any_broken, skipped = any_rank(
        signals.requested is not None, bool(broken), bool(batch.unreadable)
    )
    if any_broken:
        raise_together(broken[0] if broken else None)
    for error in batch.unreadable:
        print(f"warning: skipping {error} ({flags[type(error)]})", flush=True)
    return stop, total_over_ranks(len(batch.unreadable)) if skipped else 0


def _log(
    training: _Training, bar, step, loss, lr, epoch, samples_per_s, counts, skipped_samples
) -> dict[str, float]:
    """The global loss (each rank's loss is W x its share: the mean is it), the speed,
    ``counts`` (a mixture's steps per source) and the samples skipped so far, to the
    progress bar, the trackers and metrics.jsonl."""
    record = {
        "loss": training.accelerator.reduce(loss.detach(), "mean").item(),
        "samples_per_s": samples_per_s,
        "lr": lr,
        "epoch": epoch,
        **counts,
    }
    if skipped_samples:
        record["skipped_samples"] = skipped_samples
    bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.3g}")
    training.log(record, step)
    return {"loss": record["loss"], "samples_per_s": samples_per_s}


def _resume(accelerator, model, optimizer, method, path: str, state: RunState) -> int:
    """Load the checkpoint at ``path``; returns its step. A changed option that shapes the
    optimisation is applied and said (``resume="apply"``) or refused (``"refuse"``).
    A sharded checkpoint is checked where each rank reads its rows: a refusal on any
    rank is raised on every rank."""
    problem = None
    try:
        checkpoint, changed = resume(
            path,
            accelerator.unwrap_model(model),
            optimizer,
            state,
            resume_rules(TrainConfig),
            resolve=lambda saved: dataclasses.asdict(TrainConfig.from_saved(saved).resolved()),
        )
        method.load_state_dict(checkpoint.method_state)
    except (CheckpointError, ShardError) as error:
        problem = error
    raise_together(problem)
    for entry in changed:
        accelerator.print(f"resume: applying {entry}")
    accelerator.print(f"resumed from {path} at step {checkpoint.step}")
    return checkpoint.step


def _baselines_and_probe(training: _Training, step: int) -> dict:
    """What the trained encoder's figures mean (``figures.baselines_and_probe``), logged."""
    encoder = training.method.evaluated_encoder()
    config = training.config
    results = baselines_and_probe(encoder, training.knn, config.knn_k, config.linear_probe)
    training.log(results, step)
    return results


def _method_figures(training: _Training, step: int) -> dict:
    """The method's own figures (``method.evaluate``: zero-shot, retrieval, BEIR), logged
    like the kNN's."""
    results = training.method.evaluate(training.knn)
    if results:
        training.log(results, step)
    return results


def _flat_for_trackers(config: TrainConfig) -> dict:
    # TensorBoard's hparams take numbers, strings and booleans only.
    return {
        key: "none" if value is None else value for key, value in dataclasses.asdict(config).items()
    }


def main(argv: list[str] | None = None) -> None:
    with one_line_errors():  # every rank validates the same inputs: every rank exits, no hang
        result = train(parse_args(TrainConfig, argv, description=__doc__.split("\n")[0]))
    if result.preempted:
        exit_preempted()


if __name__ == "__main__":
    main()
