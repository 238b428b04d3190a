"""Decoupled learners: ``jaxpar launch --learners M --quorum K [--grace S] -- jaxpar train --strategy
"federation=M,..." --checkpoint-dir DIR``: the M groups of a federated run as M separate jobs, each
training at its own pace, and a syncer that merges them.

Each learner is its own job (``--processes`` of them, one ``jax.distributed`` job; one process by
default) on its own devices (its share of the topology's), training the rest
of the strategy on its rows of every global batch (learner i reads group i's rows, as
``FederatedTrainer`` does) for ``local_steps`` steps from the newest merged model. Then it saves its
state as a verified checkpoint (``DIR/learner-<i>``), reports the round and its tokens to the
syncer, and waits for the round's merge. The syncer (one more process, one device) merges a round
once K learners have reported and then either every learner has or ``grace`` seconds have passed:
it reads each reporting learner's weights back from its checkpoint (verified: a merge never holds a
partial update), averages them, or their changes for the outer optimizer, weighted by tokens, saves
the merged model and the outer optimizer's state (``DIR/merged``, verified) and announces it.

- A learner whose report comes after its round was merged is late: its update is dropped (the
  syncer records it), and it goes on from the newest merged model.
- A learner that dies is restarted by the launcher from its own last checkpoint (its copy and its
  inner optimizer state): if that round's merge included it, it takes the merged fragment as it
  would have, else the whole newest merged model, and joins the round in progress; the others go
  on meanwhile when the quorum allows.
- The syncer restarted resumes from its newest merged checkpoint; reports wait in the store.
- ``fragments=F``: a round ends at each fragment's merge (``FederatedTrainer``'s schedule) and
  merges that fragment only; a learner whose report it included takes that fragment from the
  merged model and keeps its own copy of the rest. The last step merges every fragment.
- ``merge_delay=D`` (Streaming DiLoCo's overlap): after its report a learner trains the next round's
  first D steps from its own copy while the syncer merges, then brings the merged fragment in as
  the one-process run does (``merge_mix`` of its copy's plus the rest of the merged one): the
  exchange and the merge run behind those steps. The merged model equals the one-process run's.

Control goes through JAX's coordination service, the key-value store that ``jax.distributed``
uses, hosted by the launcher with recoverable tasks (so one process may die and rejoin); the
weights through the verified checkpoints. Keys: ``report/<round>/<learner>`` (JSON: tokens,
checkpoint step) and ``merged/<round>`` (JSON: step, learners included, reports dropped).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time

import jax
import numpy as np
import optax

from jaxpar import launch
from jaxpar.errors import JaxparError
from jaxpar.models import model_and_loss
from jaxpar.parallel import build_layout, federation, parse_strategy
from jaxpar.run import RunConfig, batch_source, model_name, open_data, run_model_config
from jaxpar.topology import Topology
from jaxpar.train import data
from jaxpar.train.checkpoint import CheckpointConfig, Checkpointer
from jaxpar.train.federated import (
    check_fragments, cut, fragment_due, fragment_views, inner_strategy, mixed, outer_optimizer, put, state_views,
)
from jaxpar.train.step import Trainer

POLL_S = 0.05  # how often the syncer looks for reports
_TAKE: dict = {}  # a learner's program that puts a merged fragment into its copy, by fragment (one job a process)


def role() -> str | None:
    """'learner' or 'syncer' in a process that ``jaxpar launch --learners`` started, else None."""
    return os.environ.get(launch.ENV_ROLE)


@dataclasses.dataclass(frozen=True)
class Job:
    """What a learner or the syncer knows of the whole job."""

    run: RunConfig
    directory: str
    learners: int
    options: dict  # federation's (local steps, fragments, outer optimizer)
    keep: int  # checkpoints kept in each directory (--keep-checkpoints; every round is saved)
    identity: dict  # what its checkpoints say they are of (model, strategy, learners, steps): a restart checks it
    # (step, fragment) at the end of each round: fragment f at its steps of the fragment schedule,
    # every fragment (None) at the last step, so that the run ends with one model
    ends: tuple

    @property
    def rounds(self) -> int:
        return len(self.ends)

    def round_end(self, round_: int) -> int:
        """The step at which round ``round_`` ends (and its merged model starts the next)."""
        return self.ends[round_][0]

    def round_start(self, round_: int) -> int:
        return self.ends[round_ - 1][0] if round_ else 0

    def fragment(self, round_: int) -> int | None:
        """The fragment round ``round_`` ends with (None: the last round, which ends with all of them)."""
        return self.ends[round_][1]

    def merged_fragments(self, round_: int) -> tuple[int, ...]:
        """The fragments round ``round_``'s merge changes: its own; at the last round every one but
        those merged in the last ``merge_delay`` steps, whose merge has not reached the copies yet
        (the merged model holds them already)."""
        if self.fragment(round_) is not None:
            return (self.fragment(round_),)
        local, count, end = self.options["local_steps"], self.options["fragments"], self.run.steps
        pending = {fragment_due(step, local, count) for step in range(end - self.options["merge_delay"] + 1, end)}
        return tuple(f for f in range(count) if f not in pending)

    def views(self, trainer: Trainer, fragment: int):
        """(cuts, puts) of ``fragment`` on one copy's params (``fragment_views``)."""
        fragments = self.options["fragments"]
        layers = check_fragments(trainer, fragments, self.options["local_steps"])
        return fragment_views(trainer, fragments, layers, fragment, stacked=False)


def job_of(run: RunConfig, topology: Topology, checkpoint: CheckpointConfig | None, resume: str = "never",
           environ=os.environ) -> Job:
    """The job ``run`` describes under the launcher's ``environ``, refusing in words what does not fit
    (and, in the syncer unless ``resume``, a checkpoint directory that already holds merges)."""
    learners = int(environ[launch.ENV_LEARNERS])
    if checkpoint is None:
        raise JaxparError("decoupled learners exchange weights through checkpoints: give --checkpoint-dir DIR")
    strategy = parse_strategy(run.strategy, topology.num_chips)
    federation.check_slices(strategy, topology.num_slices)
    groups = strategy.degrees.get("federation", 1)
    if groups != learners:
        raise JaxparError(f"--learners {learners} runs federation={learners}, but --strategy {run.strategy} has "
                          f"federation={groups}; give federation={learners}")
    if run.batch_size % learners:
        raise JaxparError(f"--batch-size {run.batch_size} does not split over {learners} learners; give a multiple of {learners}")
    local, fragments = strategy.options["local_steps"], strategy.options["fragments"]
    ends = [(step, fragment_due(step, local, fragments)) for step in range(1, run.steps)]
    ends = tuple((step, f) for step, f in ends if f is not None) + ((run.steps, None),)
    merged = os.path.join(checkpoint.directory, "merged")
    if environ.get(launch.ENV_ROLE) == "syncer" and resume == "never" and os.path.isdir(merged) and os.listdir(merged):
        raise JaxparError(f"{merged} already holds merges; pass --resume to go on with that job, or choose another --checkpoint-dir")
    identity = {"model": model_name(run), "strategy": str(strategy), "learners": learners, "steps": run.steps}
    return Job(run, checkpoint.directory, learners, strategy.options, checkpoint.keep, identity, ends)


def _same_job(job: Job, directory: str):
    """A restore's check that a checkpoint in ``directory`` is of ``job``."""
    def check(meta):
        if meta.get("job") != job.identity:
            raise JaxparError(f"checkpoint in {directory} is of {meta.get('job')}, not of this job, {job.identity}: resume "
                              "with that job's options, or start another --checkpoint-dir")
    return check


def _keyed(prefix: str, entries) -> dict:
    """{the last part of each key under ``prefix``: its JSON value}."""
    return {key.rsplit("/", 1)[-1]: json.loads(value) for key, value in entries}


class Exchange:
    """This process's client of the launcher's key-value store (``launch.kv_client``)."""

    def __init__(self, node: int, timeout_s: float):
        self.client = launch.kv_client(os.environ[launch.ENV_SYNCER], node, timeout_s)

    def report(self, round_: int, learner: int, record: dict):
        self.client.key_value_set(f"report/{round_}/{learner}", json.dumps(record), allow_overwrite=True)

    def reports(self, round_: int) -> dict[int, dict]:
        return {int(k): v for k, v in _keyed(f"report/{round_}/", self.client.key_value_dir_get(f"report/{round_}/")).items()}

    def all_reports(self) -> set[tuple[int, int]]:
        """(round, learner) of every report so far."""
        return {tuple(int(part) for part in key.split("/")[1:3]) for key, _ in self.client.key_value_dir_get("report/")}

    def announce(self, round_: int, record: dict):
        self.client.key_value_set(f"merged/{round_}", json.dumps(record), allow_overwrite=True)

    def merged(self) -> dict[int, dict]:
        """{round: its merge's record} of every merge announced so far."""
        return {int(k): v for k, v in _keyed("merged/", self.client.key_value_dir_get("merged/")).items()}

    def wait_merged(self, after: int, poll_s: float = 0.2) -> int:
        """The newest merged round, once it is past ``after``."""
        while True:
            done = self.merged()
            if done and max(done) > after:
                return max(done)
            time.sleep(poll_s)


# --- a learner ------------------------------------------------------------------------------------


class _LearnerRows:
    """Learner i's rows of every global batch: group i's of a ``FederatedTrainer``."""

    def __init__(self, trainer: Trainer, learner: int, learners: int):
        self.trainer, self.learner, self.learners = trainer, learner, learners

    def put_process_batch(self, batch_size: int, rows):
        share = batch_size // self.learners
        first = self.learner * share
        return self.trainer.put_process_batch(share, lambda a, b: rows(first + a, first + b))


def learn(job: Job, topology: Topology, progress=sys.stderr) -> None:
    """Learner ``$JAXPAR_LEARNER``'s part of ``job`` (see the module doc)."""
    learner = int(os.environ[launch.ENV_LEARNER])
    log = (lambda message: print(f"learner {learner}: {message}", file=progress, flush=True)) if progress else (lambda m: None)
    run, faults = job.run, launch.parse_faults(os.environ.get(launch.ENV_FAULTS, ""), job.learners).get(learner, {})
    inner = parse_strategy(inner_strategy(parse_strategy(run.strategy, topology.num_chips)), len(jax.devices()))
    cfg = run_model_config(run)
    train_cfg = dataclasses.replace(run.train, total_steps=run.steps, memory_bytes=run.train.memory_bytes or topology.hbm_bytes)
    trainer = Trainer(build_layout(inner, jax.devices()), *model_and_loss(cfg), train_cfg)
    check_fragments(trainer, job.options["fragments"], job.options["local_steps"])  # before any work
    own = open_data(run, log)
    tokens, held_out = data.split_corpus(data.corpus_tokens()) if own is None else (None, None)
    train_rows, _, batch_of = batch_source(run, _LearnerRows(trainer, learner, job.learners), cfg, tokens, held_out, own)
    exchange = Exchange(int(os.environ[launch.ENV_TASK]), launch.startup_timeout(os.environ))
    mine = Checkpointer(CheckpointConfig(os.path.join(job.directory, f"learner-{learner}"), every=1, keep=job.keep))
    try:
        state, last = _learner_start(job, trainer, mine, log)
        round_ = exchange.wait_merged(-1)
        share, delay = run.batch_size // job.learners * run.seq_len, job.options["merge_delay"]
        train = lambda state, start, stop: _train_steps(trainer, state, start, stop, lambda step: batch_of(train_rows, step), faults, learner)
        while True:
            early = None  # (with merge_delay) the next round's first steps, trained while the syncer merges
            if last is not None and round_ == last and learner not in exchange.reports(last) and jax.process_index() == 0:
                exchange.report(last, learner, {"tokens": share * (job.round_end(last) - job.round_start(last)),
                                                "step": job.round_end(last)})  # (its process 0 speaks for it)
            if delay and last is not None and round_ in (last, last + 1) and last + 1 < job.rounds:
                early = train(state, job.round_start(last + 1), min(job.round_start(last + 1) + delay, job.round_end(last + 1)))
            if last is not None and round_ == last:  # after its report (or, restarted, its save): the merge is to come
                round_ = exchange.wait_merged(last)
                log(f"round {round_} merged")
            if round_ >= job.rounds:
                break
            ours = last is not None and round_ == last + 1 and learner in exchange.merged()[round_]["included"]
            start = job.round_start(round_)
            if ours and early is not None:  # Streaming DiLoCo's overlap: the merged fragment mixed in D steps late
                start = int(early.step)
                state = _take_merged(job, trainer, early, round_, last, job.options["merge_mix"]) if start == job.round_start(round_) + delay else early
            else:  # the merged fragment, or (behind) the whole merged model
                state = _take_merged(job, trainer, state, round_, last if ours else None)
                if last is not None and not ours:
                    log(f"its report of round {last} was not merged: goes on from the merged model at step {start}")
            state = train(state, start, job.round_end(round_))
            mine.save(job.round_end(round_), state, {"round": round_, "learner": learner, "job": job.identity})
            mine.wait()  # the report names a complete checkpoint, never one being written
            last = round_
    finally:
        mine.close()


def _learner_start(job: Job, trainer: Trainer, mine: Checkpointer, log):
    """(a fresh state, None), or (a restarted learner) (its state as it saved it at the end of a
    round, that round): its copy and its inner optimizer state are not lost."""
    if mine.latest_step() is None:
        return trainer.init(job.run.seed), None
    state, meta = mine.restore_newest_verified(trainer.abstract_state(), log, _same_job(job, mine.directory))
    log(f"restarted from its checkpoint of round {meta['round']}")
    return state, meta["round"]


def _take_merged(job: Job, trainer: Trainer, state, round_: int, merged_part: int | None, keep: float | None = None):
    """``state`` with the merged model of round ``round_``'s start: its weights and step, or only
    the fragment that round ``merged_part`` merged, where the learner goes on from its own copy;
    with ``keep`` (a delayed merge) that fragment becomes ``keep`` of the copy's plus the rest of
    the merged one, and the step stays."""
    merged = Checkpointer(CheckpointConfig(os.path.join(job.directory, "merged")), writer=False)
    try:
        params = merged.restore_params(trainer.abstract_state().params, job.round_start(round_))
    finally:
        merged.close()
    if merged_part is not None:
        fragment = job.fragment(merged_part)
        if (fragment, keep) not in _TAKE:  # one program per fragment and mix
            cuts, puts = job.views(trainer, fragment)

            def take(mine, new):
                return put(mine, cut(new, cuts) if keep is None else mixed(cut(mine, cuts), cut(new, cuts), keep), puts)

            _TAKE[fragment, keep] = jax.jit(take, out_shardings=trainer.state_shardings.params)
        params = _TAKE[fragment, keep](state.params, params)
    if keep is not None:
        return state._replace(params=params)
    step = jax.device_put(np.asarray(job.round_start(round_), state.step.dtype), state.step.sharding)
    return state._replace(params=params, step=step)


def _train_steps(trainer: Trainer, state, start: int, stop: int, batch_at, faults: dict, learner: int):
    for step in range(start, stop):
        if faults.get("kill") == step and not os.environ.get(launch.ENV_RESUME):  # the drill's fault, once
            print(f"learner {learner}: killed at step {step} (--inject-faults)", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        state, _ = trainer.step(state, batch_at(step))
        launch.report_progress("done", step + 1)
        if faults.get("slow"):
            time.sleep(faults["slow"])
    jax.block_until_ready(state.params)
    return state


# --- the syncer -----------------------------------------------------------------------------------


def sync(job: Job, topology: Topology, progress=sys.stderr) -> dict:
    """The syncer's part of ``job``: every round's merge; returns the job's report."""
    log = (lambda message: print(f"syncer: {message}", file=progress, flush=True)) if progress else (lambda m: None)
    quorum, grace = int(os.environ[launch.ENV_QUORUM]), float(os.environ[launch.ENV_GRACE])
    cfg = run_model_config(job.run)
    one = dataclasses.replace(job.run.train, grad_sync="exact", grad_sync_bits=None, grad_sync_axes=None)  # (no batch axis here)
    trainer = Trainer(build_layout(parse_strategy("", 1), jax.devices("cpu")[:1]), *model_and_loss(cfg), one)
    check_fragments(trainer, job.options["fragments"], job.options["local_steps"])  # before any work
    outer = outer_optimizer(job.options)
    merged = Checkpointer(CheckpointConfig(os.path.join(job.directory, "merged"), every=1, keep=max(job.keep, 2)))
    exchange = Exchange(int(os.environ[launch.ENV_TASK]), launch.startup_timeout(os.environ))
    began = time.time()
    try:
        (anchor, outer_state), round_, history = _syncer_start(job, trainer, outer, merged, log)
        exchange.announce(round_, history["merges"][-1]["record"] if history["merges"] else {"step": 0, "included": []})
        while round_ < job.rounds:
            reports = _gather(exchange, round_, job.learners, quorum, grace)
            anchor, outer_state = _merge(job, trainer, outer, (anchor, outer_state), reports, round_)
            late = _late(exchange, round_, history)
            record = {"step": job.round_end(round_), "included": sorted(reports),
                      "tokens": sum(r["tokens"] for r in reports.values()), "dropped": late, "time_s": time.time() - began}
            history["merges"].append({"round": round_ + 1, "record": record})
            merged.save(job.round_end(round_), {"params": anchor, "outer": outer_state},
                        {"round": round_ + 1, "history": json.loads(json.dumps(history)), "job": job.identity})
            merged.wait()
            round_ += 1
            exchange.announce(round_, record)
            log(f"round {round_} merged from learners {sorted(reports)}" + (f"; dropped late reports {late}" if late else ""))
    finally:
        merged.close()
    return _sync_report(job, trainer, anchor, history, time.time() - began, quorum, grace)


def _syncer_start(job: Job, trainer: Trainer, outer, merged: Checkpointer, log):
    """((the merged model, the outer state), the round it starts, history): round 0's model from the
    seed (saved first, so that every learner starts from it), or the newest merged checkpoint's."""
    params = trainer.init(job.run.seed).params
    state = (params, outer.init(params) if outer else None)
    if merged.latest_step() is None:
        merged.save(0, {"params": state[0], "outer": state[1]}, {"round": 0, "history": {"merges": []}, "job": job.identity})
        merged.wait()
        return state, 0, {"merges": []}
    abstract = {"params": trainer.abstract_state().params, "outer": _abstract(state[1])}
    restored, meta = merged.restore_newest_verified(abstract, log, _same_job(job, merged.directory))
    log(f"resuming from the merge of round {meta['round']}")
    return (restored["params"], restored["outer"]), meta["round"], meta["history"]


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _gather(exchange: Exchange, round_: int, learners: int, quorum: int, grace: float) -> dict[int, dict]:
    """The round's reports once ``quorum`` are in and then all are or ``grace`` seconds have passed."""
    quorum_at = None
    while True:
        reports = exchange.reports(round_)
        if len(reports) >= quorum and quorum_at is None:
            quorum_at = time.time()
        if len(reports) == learners or (quorum_at is not None and time.time() - quorum_at >= grace):
            return reports
        time.sleep(POLL_S)


def _merge(job: Job, trainer: Trainer, outer, merged: tuple, reports: dict, round_: int):
    """(the model, the outer state) with round ``round_``'s fragments merged from the reports'
    weights (read back verified), weighted by tokens: their mean (avg), or the outer optimizer's
    step on their mean change; fragment by fragment, as ``FederatedTrainer.merge_all`` does."""
    anchor, outer_state = merged
    total = sum(r["tokens"] for r in reports.values())
    weights = [r["tokens"] / total for _, r in sorted(reports.items())]
    copies = [_learner_params(job, trainer, learner, r["step"]) for learner, r in sorted(reports.items())]
    for fragment in job.merged_fragments(round_):
        cuts, puts = job.views(trainer, fragment)
        parts, part = [cut(copy, cuts) for copy in copies], cut(anchor, cuts)
        if outer is None:
            anchor = put(anchor, jax.tree.map(lambda *c: sum(w * x for w, x in zip(weights, c)), *parts), puts)
            continue
        change = jax.tree.map(lambda a, *c: sum(w * (a - x) for w, x in zip(weights, c)), part, *parts)
        cut_state, put_state = state_views(outer, outer_state, cuts, puts)
        updates, moved = outer.update(change, cut_state, part)
        anchor, outer_state = put(anchor, optax.apply_updates(part, updates), puts), put_state(moved)
    return anchor, outer_state


def _learner_params(job: Job, trainer: Trainer, learner: int, step: int):
    ckpt = Checkpointer(CheckpointConfig(os.path.join(job.directory, f"learner-{learner}")), writer=False)
    try:
        return ckpt.restore_params(trainer.abstract_state().params, step)
    finally:
        ckpt.close()


def _late(exchange: Exchange, round_: int, history: dict) -> list[list[int]]:
    """[round, learner] of each report, newly seen, for a round merged without it (dropped): a slow
    learner may be rounds behind, the others having merged without it meanwhile."""
    seen = {tuple(d) for m in history["merges"] for d in m["record"]["dropped"]}
    included = {m["round"] - 1: set(m["record"]["included"]) for m in history["merges"]}
    return [[r, learner] for r, learner in sorted(exchange.all_reports())
            if r in included and learner not in included[r] and (r, learner) not in seen]


def _sync_report(job: Job, trainer: Trainer, anchor, history: dict, seconds: float, quorum: int, grace: float) -> dict:
    run = job.run
    merges = [m["record"] for m in history["merges"]]
    useful = sum(m["tokens"] for m in merges)
    return {
        "role": "syncer", "model": run.model, "strategy": run.strategy, "learners": job.learners, "quorum": quorum,
        "grace_s": grace, "local_steps": job.options["local_steps"], "fragments": job.options["fragments"],
        "steps": run.steps, "rounds": job.rounds, "merges": merges,
        "useful_tokens": useful, "tokens_planned": run.steps * run.batch_size * run.seq_len, "seconds": seconds,
        "goodput_tokens_per_s": useful / seconds if seconds else 0.0,
        "dropped": [d for m in merges for d in m["dropped"]],
        "held_out_loss": _held_out_loss(run, trainer, anchor),
    }


def _held_out_loss(run: RunConfig, trainer: Trainer, params) -> float:
    cfg = run_model_config(run)
    own = open_data(run, lambda message: None)
    tokens, held_out = data.split_corpus(data.corpus_tokens()) if own is None else (None, None)
    _, held, batch_of = batch_source(run, trainer, cfg, tokens, held_out, own)
    batch = batch_of(held, 0)
    return float(trainer.jit_loss(batch)(params, batch))


def summary(report: dict) -> list[str]:
    """The syncer's report for a terminal."""
    lines = [f"{report['model']} as {report['learners']} decoupled learners (quorum {report['quorum']}, grace "
             f"{report['grace_s']:g} s), merging every {report['local_steps']} steps"
             + (f" a 1/{report['fragments']} share at a time" if report["fragments"] > 1 else "") + f": {len(report['merges'])} merges",
             f"held-out loss {report['held_out_loss']:.4f} (the merged model)",
             f"goodput {report['goodput_tokens_per_s']:,.0f} useful tokens/s: {report['useful_tokens']:,} of "
             f"{report['tokens_planned']:,} planned tokens merged in {report['seconds']:.1f} s"]
    for merge in report["merges"]:
        missing = sorted(set(range(report["learners"])) - set(merge["included"]))
        lines.append(f"  merge at step {merge['step']}: learners {merge['included']}" + (f" (without {missing})" if missing else "")
                     + (f"; dropped late {merge['dropped']}" if merge["dropped"] else ""))
    return lines
