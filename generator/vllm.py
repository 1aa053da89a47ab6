"""ngramd as vLLM's speculative proposer: ``method="custom_class"``.

    from vllm import LLM
    llm = LLM(model, speculative_config={
        "method": "custom_class", "model": "ngram_generator.vllm.NgramdProposer",
        "num_speculative_tokens": 8})

or ``vllm serve MODEL --speculative-config '{"method": "custom_class", "model":
"ngram_generator.vllm.NgramdProposer", "num_speculative_tokens": 8}'``.

vLLM (V1 model runner; 0.32 picks it by itself for ``custom_class``, and refuses ``custom_class``
in its V2 runner) builds the class with its config in the engine process and calls
:meth:`NgramdProposer.propose` once per step with every row's tokens.  The drafting is
``ngram-generate``'s, through :class:`~.batch.BatchDrafter`: one ``NgramDrafter`` per request
(the request-local table, the hot and recent tiers read from shared memory in-process, the
daemon asked asynchronously, one message per step), every finished request fed back once, and a
slow or absent daemon never waited for (``DaemonLink``).

Configuration (the environment wins over the file):

* ``NGRAMD_ENDPOINT``: the daemon (default: the client's default endpoint);
* ``NGRAM_SERVER_KEY``: the daemon's CurveZMQ public key file, for ``tcp://`` endpoints;
* ``NGRAM_PROPOSER_CONFIG``: a TOML file with a ``[proposer]`` table (:class:`ProposerSettings`:
  ``endpoint``, ``server_key``, ``client_key``, ``timeout_ms``, ``learn_prompts``, ``park_s``,
  ``idle_s``, ``full_drafts``, ``step_clock``, ``remote_budget_ms``, ``ask_backoff``,
  ``feedback_max_tokens``, ``log_interval_s``, ``stats_file``, ``keep_policy``,
  ``policy_key``);
* ``NGRAM_PROPOSER_STATS``: a JSON file the proposer rewrites every ``log_interval_s``, once
  the engine has had no step for a moment after some, and at exit (what it drafted and
  accepted per tier, its link, its step times);
* ``NGRAM_PROPOSER_METRICS_PORT``: serve the proposer's counters for Prometheus on this port
  (``metrics_port``; ``vllmobs``: vLLM's own ``/metrics`` is another process's).

The proposer's lines go to vLLM's log (``vllmobs.attach_to_vllm_log``): one at start (the
endpoint, the table, the tokenizer check), one every ``log_interval_s``, one at shutdown.

What the draft-length policy learned (``ngram_generator.policy``: the acceptance of the table's
drafts, the step cost) is kept in the table under ``policy_key`` (``ngramd``'s ``save_policy``:
every ``log_interval_s`` and at shutdown), and the next engine to start takes it up
(``keep_policy``): a restarted server does not relearn it on its first requests.

vLLM passes a ``custom_class`` proposer no sampling parameters; the proposer reads each row's
temperature and whether the batch asks for top-p/top-k from the input batch of the model runner
that calls it (:class:`SamplingView`), so sampled requests are priced by their own acceptance
and a sampled step by its own cost (``ngram_generator.policy``'s bands and kinds).  Its summary,
stats file and policy state are written from its own thread, never in a step.

Orders, stop rules and the draft limit are the table's (its ``info()``); the draft is at most
``num_speculative_tokens``.  The proposer proves the fingerprint of the tokenizer vLLM loaded: a
table of another tokenizer is refused with one warning, and drafting goes on from each request
alone.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ngramd.wire.errors import BadInput
from ngramd.wire.rules import DraftRules
from ngramd.wire.settings import from_dict, read_toml

from . import vllmfix
from .batch import BatchDrafter, BatchSettings
from .drafting import DraftConfig, settings_from_table
from .policy import RunClock, StepCost, checked_key, state_key, summary, take_up
from .remote import DaemonLink
from .tracker import IdleWatch
from .vllmobs import attach_to_vllm_log, serve_metrics

log = logging.getLogger(__name__)

ENV_ENDPOINT = "NGRAMD_ENDPOINT"
ENV_SERVER_KEY = "NGRAM_SERVER_KEY"
ENV_CONFIG = "NGRAM_PROPOSER_CONFIG"
ENV_STATS = "NGRAM_PROPOSER_STATS"
ENV_METRICS_PORT = "NGRAM_PROPOSER_METRICS_PORT"
ENV_V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"


#: ``[proposer] step_clock``: what each makes (a callable returning seconds)
STEP_CLOCKS = {"run": RunClock, "wall": lambda: time.perf_counter}


@dataclass(frozen=True)
class ProposerSettings:
    """The proposer's own settings (the drafting rules are the table's)."""

    endpoint: str | None = None  # None: $NGRAMD_ENDPOINT, else the client's default endpoint
    server_key: str | None = None  # CurveZMQ: the daemon's public key file (tcp endpoints)
    client_key: str | None = None  # CurveZMQ: this client's secret key file, if the daemon asks
    timeout_ms: int = 1000  # per daemon call; nothing in a step waits for one
    learn_prompts: bool | None = None  # None: as the table says ([table] learn_prompts)
    park_s: float = BatchSettings.park_s  # a request missing this long from the batch is done
    idle_s: float = 5.0  # no step this long (and 4x the p90 recent gap): the engine is idle
    # true: verify every draft in full; false: the draft tokens that the step cost measured
    # in this engine and the acceptance learned from its outputs pay for (ngram_generator.policy)
    full_drafts: bool = False
    # how the policy times the engine's steps: "run", wall time less the time the worker's
    # thread waited for a CPU (a busy host's share, taken out: ngram_generator.policy.RunClock);
    # "wall", the wall clock
    step_clock: str = "run"
    remote_budget_ms: float = DraftConfig.remote_budget_ms  # the daemon's cold reads per ask
    # while the daemon's answers are not used, at most every ask_backoff-th short draft asks
    # (ngram_generator.drafting.AskGate; 1: every one)
    ask_backoff: int = DraftConfig.ask_backoff
    feedback_max_tokens: int = 4 << 20  # feedback held while the daemon is down
    log_interval_s: float = 60.0  # one summary line (and the stats file) this often
    stats_file: str | None = None  # default: $NGRAM_PROPOSER_STATS
    metrics_port: int = 0  # serve Prometheus metrics here (0: off); $NGRAM_PROPOSER_METRICS_PORT
    metrics_addr: str = "127.0.0.1"  # loopback: the counters are for this host's scraper
    # keep the draft-length policy's learned state in the table (saved every log_interval_s
    # and at shutdown, taken up at start), so a restarted engine starts where the last one
    # stopped; under policy_key (default "<device>:<model>": engines of one model on one kind
    # of device share what they learned)
    keep_policy: bool = True
    policy_key: str | None = None

    def __post_init__(self):
        if self.policy_key is not None:
            checked_key(self.policy_key)  # what the daemon would refuse, refused here
        if self.step_clock not in STEP_CLOCKS:
            raise BadInput(f"step_clock must be one of {sorted(STEP_CLOCKS)}, "
                           f"got {self.step_clock!r}")

    @classmethod
    def load(cls, environ=os.environ) -> "ProposerSettings":
        """``[proposer]`` of the file ``$NGRAM_PROPOSER_CONFIG`` (if set), then the environment.
        Unknown sections and keys and wrong types are a ``BadInput`` (a ``ValueError``) naming
        the file and the key (``ngramd.wire.settings``, as the daemon's config)."""
        settings = cls()
        path = environ.get(ENV_CONFIG)
        if path:
            label = f"{ENV_CONFIG}={path}"
            try:
                settings = from_dict(_ProposerFile, read_toml(Path(path), label)).proposer
            except BadInput as e:
                raise BadInput(f"{label}: {e}") from None
        env = {"endpoint": environ.get(ENV_ENDPOINT), "server_key": environ.get(ENV_SERVER_KEY),
               "stats_file": environ.get(ENV_STATS)}
        port = environ.get(ENV_METRICS_PORT)
        if port:
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise BadInput(f"{ENV_METRICS_PORT}={port!r}: expected a port, 1..65535")
            env["metrics_port"] = int(port)
        return replace(settings, **{k: v for k, v in env.items() if v})


@dataclass(frozen=True)
class _ProposerFile:
    """A proposer settings file: one ``[proposer]`` table."""

    proposer: ProposerSettings = field(default_factory=ProposerSettings)


def require_v1_runner(environ=os.environ) -> None:
    """Refuse vLLM's V2 model runner: it has no plug-in point for a proposer."""
    value = environ.get(ENV_V2_RUNNER)
    if value is not None and value.strip().lower() not in ("0", "false", "no", "off", ""):
        raise RuntimeError(
            f"ngram_generator.vllm.NgramdProposer needs vLLM's V1 model runner, which is the "
            f"one that loads method='custom_class' proposers; {ENV_V2_RUNNER}={value!r} asks "
            f"for V2: set {ENV_V2_RUNNER}=0")


def tokenizer_fingerprint_of(model_config) -> str | None:
    """The fingerprint of the tokenizer vLLM loads (``model_config.tokenizer``): from its
    tokenizer.json when it is a local directory, else from the tokenizer transformers loads.
    None (logged) when neither works: then the daemon cannot check the ids."""
    from ngramd.wire.identity import hf_tokenizer_fingerprint, tokenizer_fingerprint

    where = str(getattr(model_config, "tokenizer", "") or getattr(model_config, "model", ""))
    try:
        if (Path(where) / "tokenizer.json").is_file():
            return tokenizer_fingerprint(where)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(
            where, revision=getattr(model_config, "tokenizer_revision", None),
            trust_remote_code=bool(getattr(model_config, "trust_remote_code", False)))
        return hf_tokenizer_fingerprint(tok)
    except Exception as e:
        log.warning("cannot fingerprint the tokenizer at %s (%s): the daemon cannot check "
                    "that these ids match its table", where, e)
        return None


class SamplingView:
    """What vLLM samples each row of its batch with: the temperatures and top-p/top-k of its
    model runner's input batch, found once (and again when vLLM replaces it).

    ``custom_class`` proposers get no sampling parameters, but vLLM's runner calls
    ``propose`` with its input batch's own token array; the runner is found up the caller's
    frames as the object whose ``input_batch.token_ids_cpu`` *is* that array, so a match is
    never a guess.  Where none is found (another vLLM, another engine), every row reads as
    greedy, as before."""

    FRAMES = 8  # caller frames searched

    def __init__(self):
        self._batch = None
        self._tried = None  # the array searched for last without finding its batch

    def read(self, token_ids_cpu, rows: int) -> tuple | None:
        """``(temperatures, filtered)`` of the first ``rows`` rows (``BatchDrafter.step``'s
        ``sampling``), or None when the batch is not found."""
        batch = self._batch
        if batch is None or batch.token_ids_cpu is not token_ids_cpu:
            if self._tried is token_ids_cpu:
                return None
            batch = self._batch = self._find(token_ids_cpu)
            self._tried = None if batch is not None else token_ids_cpu
            if batch is None:
                return None
        filtered = not (getattr(batch, "no_top_p", True) and getattr(batch, "no_top_k", True))
        return batch.temperature_cpu[:rows], filtered

    def _find(self, token_ids_cpu):
        frame = sys._getframe(2)  # the caller of propose()
        for _ in range(self.FRAMES):
            if frame is None:
                break
            owner = frame.f_locals.get("self")
            batch = getattr(owner, "input_batch", None)
            if (getattr(batch, "token_ids_cpu", None) is token_ids_cpu
                    and hasattr(batch, "temperature_cpu")):
                return batch
            frame = frame.f_back
        return None


class NgramdProposer:
    """vLLM's ``custom_class`` proposer, drafting from ngramd (module doc)."""

    WATCH_S = 0.25  # how often the proposer's thread looks at the engine (s)
    QUIET_S = 0.25  # no step this long after some: the stats file is rewritten (s)

    def __init__(self, vllm_config, *, settings: ProposerSettings | None = None,
                 link: DaemonLink | None = None):
        require_v1_runner()
        attach_to_vllm_log()
        vllmfix.apply()  # the plug-in did, unless VLLM_PLUGINS left it out
        spec = vllm_config.speculative_config
        model = vllm_config.model_config
        self.settings = s = settings or ProposerSettings.load()
        self.num_speculative_tokens = int(spec.num_speculative_tokens)
        self.max_model_len = int(model.max_model_len)
        if link is None:
            options = {k: v for k, v in (("server_key", s.server_key),
                                         ("client_key", s.client_key)) if v}
            link = DaemonLink(s.endpoint or _default_endpoint(), timeout_ms=s.timeout_ms,
                              feedback_max_tokens=s.feedback_max_tokens,
                              tokenizer_fingerprint=tokenizer_fingerprint_of(model),
                              client_options=options)
        self.link = link
        link.connect()
        base = DraftConfig(DraftRules(max_draft_len=self.num_speculative_tokens),
                           remote_budget_ms=s.remote_budget_ms, ask_backoff=s.ask_backoff)
        config = settings_from_table(link.info if link.available else {}, base,
                                     {"max_draft_len": self.num_speculative_tokens})
        self.drafter = BatchDrafter(config, link, vocab_size=int(model.get_vocab_size()),
                                    settings=BatchSettings(park_s=s.park_s,
                                                           full_drafts=s.full_drafts),
                                    learn_prompts=s.learn_prompts,
                                    cost=StepCost.for_device(_device_type(vllm_config)),
                                    step_clock=STEP_CLOCKS[s.step_clock]())
        self.policy_key = s.policy_key or state_key(_device_type(vllm_config), model.model)
        self._next_log = time.monotonic() + s.log_interval_s
        self._sampling = SamplingView()
        self._last_step = time.monotonic()  # when propose() last returned
        self._stats_mark: tuple = ()  # _mark() when the stats file was last written
        self._closed = False
        # vLLM calls nothing once the last request is done: a timer finishes (feeds back) the
        # requests of an idle engine; the lock keeps it out of a step
        self._lock = threading.Lock()
        self._idle_watch = IdleWatch(max(s.idle_s, s.park_s))
        self._mark_at_report: tuple = ()
        self._idle_timer = threading.Thread(target=self._watch_idle, daemon=True,
                                            name="ngram-proposer-idle")
        self._idle_timer.start()
        _register_exit(self)
        self._metrics = (serve_metrics(self.stats, s.metrics_port, s.metrics_addr)
                         if s.metrics_port else None)
        self._say_start(config)
        if s.keep_policy:
            log.info("ngramd proposer: %s", take_up(self.drafter.policy, link, self.policy_key))

    def _say_start(self, config) -> None:
        """The start line: where the daemon is, which table, what the tokenizer check said."""
        link = self.link
        table = link.info.get("hot", {}).get("table") if link.info else None
        check = {"up": "tokenizer matches the table's",
                 "refused": f"refused ({link.stats().get('why')}): drafting from each request "
                            f"alone"}.get(link.state, f"not checked yet: ngramd {link.state} "
                                                      f"({link.stats().get('why')})")
        log.info("ngramd proposer: ngramd at %s, table %s; %s; orders %d..%d, up to %d tokens "
                 "a draft; a summary every %g s", link.endpoint,
                 repr(table) if table else "unknown", check, config.rules.n_min,
                 config.rules.n_max, config.rules.max_draft_len, self.settings.log_interval_s)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        """One draft per row of the batch (vLLM's ``custom_class`` contract)."""
        batch = len(sampled_token_ids)
        num = np.asarray(num_tokens_no_spec[:batch])
        limits = np.minimum(self.num_speculative_tokens, self.max_model_len - num - 1)
        sampling = self._sampling.read(token_ids_cpu, batch)
        with self._lock:
            busy = self.drafter.active  # requests were running: this gap is a step's, not idle
            drafts = self.drafter.step(sampled_token_ids, num, token_ids_cpu, limits.tolist(),
                                       sampling)
            self._idle_watch.stepped(bool(busy))
        self._last_step = time.monotonic()
        return drafts

    def _watch_idle(self) -> None:
        """The proposer's own thread, so nothing but drafting runs on vLLM's step thread.
        vLLM calls nothing once its last request is done: when ``IdleWatch`` takes the
        engine for idle (no step for ``idle_s`` and its step thread using no CPU), the requests
        still held are finished and fed back.  A request that was only slow is recognised when
        it steps again (``BatchDrafter.idle``), so nothing is counted twice.  The summary line,
        the stats file and the policy's state go out every ``log_interval_s`` (``report``), and
        the stats file also once the engine has had no step for ``QUIET_S`` after some: a
        reader that waits for it (a benchmark between two runs) reads every step of the run."""
        s = self.settings
        while not self._closed:
            time.sleep(min(self.WATCH_S, max(s.park_s / 2, 0.05)))
            ran = self._idle_watch.thread_ran()  # a read of /proc, outside the lock
            with self._lock:
                if self._closed:
                    return
                if self.drafter.active and self._idle_watch.idle(ran):
                    self.drafter.idle()
            now = time.monotonic()
            if now >= self._next_log and self._changed():
                self.report()
            elif (s.stats_file and now - self._last_step >= self.QUIET_S
                  and self._mark() != self._stats_mark):
                self._write_stats()

    def _mark(self) -> tuple:
        """What the figures hang on: steps, requests finished, the link's feedback."""
        link = self.link.stats()
        return (self.drafter.stats.steps, self.drafter.tracker.counts.finished,
                link.get("feedback_sent", 0), link.get("queued_seqs", 0), link["state"])

    def _changed(self) -> bool:
        """Whether anything was drafted, finished or sent since the last report."""
        mark = self._mark()
        changed, self._mark_at_report = mark != self._mark_at_report, mark
        return changed

    def load_model(self, *args, **kwargs) -> None:
        """vLLM asks every proposer to load its model; this one has none."""

    def stats(self) -> dict:
        """What the proposer did: drafts and acceptance per tier, requests, step times, link.
        Taken under the step lock: the drafter's report learns the outcomes a step kept (the
        policy's ``update``), and it is read from other threads (the idle watch, a metrics
        scrape) while vLLM's thread steps."""
        with self._lock:
            proposer = self.drafter.report()
        return {"proposer": proposer, "link": self.link.stats()}

    def report(self) -> None:
        """One log line, and the stats file when configured."""
        self._next_log = time.monotonic() + self.settings.log_interval_s
        s = self.stats()
        p, link = s["proposer"], s["link"]
        log.info("ngramd proposer: %d steps, %d requests done; drafted %d tokens, accepted %d "
                 "(%.0f%%; by tier %s); propose %.2f ms p50 / %.2f ms p99 a step; daemon "
                 "asks %d (not sent %d, 1 in %d); link %s, feedback sent %d, queued %d, "
                 "dropped %d", p["steps"], p["finished"],
                 p["drafted_tokens"], p["accepted_tokens"], 100 * p["acceptance"],
                 p["accepted_by_tier"], p["propose_ms_p50"], p["propose_ms_p99"],
                 p["asks_sent"], p["asks_not_sent"], p["ask_interval"],
                 link["state"], link.get("feedback_sent", 0), link["queued_seqs"],
                 link.get("feedback_dropped", 0))
        if not p["full_drafts"]:
            log.info("ngramd proposer %s", summary(p["policy"]))
        self._write_stats(s)
        if self.settings.keep_policy and self.link.available:
            with self._lock:  # not while a step learns
                state = self.drafter.policy.state()
            self.link.save_policy(self.policy_key, state)

    def _write_stats(self, s: dict | None = None) -> None:
        """The stats file, when configured: ``stats()`` (``s``, when just taken) and the steps
        the greedy cost curve was fitted to (the file's only)."""
        path = self.settings.stats_file
        if not path:
            return
        mark = self._mark()
        with self._lock:
            if s is None:
                s = {"proposer": self.drafter.report(), "link": self.link.stats()}
            steps = self.drafter.policy.cost.recent()
        _write_json(Path(path), {**s, "cost_steps": steps})
        self._stats_mark = mark

    def close(self) -> None:
        """Feed back what is running (engine shutdown), wait a little for it, and close."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.drafter.finish_all()
        self.link.flush(5.0)
        self.report()  # and the policy's state, sent after the feedback
        self.link.flush(5.0 + self.settings.timeout_ms / 1e3)
        self.link.close()
        if self._metrics is not None:
            self._metrics.shutdown()
        log.info("ngramd proposer: closed (engine shutdown); link %s", self.link.state)


def _device_type(vllm_config) -> str:
    """``cuda``, ``cpu``, ...: where vLLM runs the model (the step-cost prior depends on it)."""
    device = getattr(vllm_config, "device_config", None)
    return str(getattr(device, "device_type", None) or "cpu")


def _default_endpoint() -> str:
    from ngramd.wire.protocol import default_endpoint

    return default_endpoint()


def _register_exit(proposer: NgramdProposer) -> None:
    ref = weakref.ref(proposer)

    def close():
        p = ref()
        if p is not None:
            try:
                p.close()
            except Exception as e:  # at exit: say it, never raise
                log.warning("ngramd proposer: closing failed: %s", e)

    atexit.register(close)
    # an engine process started by multiprocessing with fork leaves by os._exit, which runs no
    # atexit hook, only multiprocessing's finalizers: the last line and feedback need one
    import multiprocessing.util

    multiprocessing.util.Finalize(None, close, exitpriority=10)


def _write_json(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, default=_plain)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("ngramd proposer: cannot write %s (%s)", path, e)


def _plain(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")


__all__ = ["NgramdProposer", "ProposerSettings"]
