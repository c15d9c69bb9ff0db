"""Where a sweep's trials come from: a fixed list (grid, ablation) or an Optuna study (random, TPE).

Both hand out trials one at a time (`next`, safe from several threads) and hear how each ended (`finish`),
so the place that runs them (emotune.sweep.backends) does not care which it is.

The Optuna study lives in a journal file in the sweep folder (`optuna.journal`, Optuna's JournalStorage):
every ask and tell is appended as it happens, so it survives a crash. A trial the journal still shows
as running when the sweep starts again was cut short by that crash; it is handed out first, with its
own number and parameters, and so resumes in its own run folder.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from emotune.core.config.sweep import Param
from emotune.core.errors import UserError
from emotune.sweep.space import Trial, trial_name

STUDY_NAME = "emotune-sweep"


@dataclass(frozen=True)
class Outcome:
    """How a trial ended: the exit status of its `emotune run`, and its metric when it finished."""

    returncode: int
    value: float | None = None


class ListSource:
    """The trials of a grid or ablation sweep still to run, in order."""

    adaptive = False  # the next trial does not depend on the results so far

    def __init__(self, trials: list[Trial]):
        self._pending = deque(trials)
        self._lock = threading.Lock()

    def next(self) -> Trial | None:
        with self._lock:
            return self._pending.popleft() if self._pending else None

    def finish(self, trial: Trial, outcome: Outcome) -> None:
        pass


def require_optuna():
    try:
        import optuna
    except ImportError:
        raise UserError("sweep.mode=random and tpe search with Optuna, which is not installed. Install it with "
                        "pip install 'emotune[optuna]' (or pip install optuna), or use sweep.mode=grid.") from None
    return optuna


class OptunaSource:
    """Trials drawn by Optuna's random or TPE sampler until `budget` trials have been drawn in all (finished,
    failed or running, over every run of the sweep)."""

    def __init__(self, journal: Path, params: list[Param], sampler: str, direction: str, budget: int, seed: int):
        optuna = require_optuna()
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._optuna = optuna
        chosen = optuna.samplers.TPESampler(seed=seed) if sampler == "tpe" else optuna.samplers.RandomSampler(seed=seed)
        self.adaptive = sampler == "tpe"  # TPE draws from what the finished trials scored
        self.study = optuna.create_study(storage=JournalStorage(JournalFileBackend(str(journal))), study_name=STUDY_NAME,
                                         sampler=chosen, direction=direction, load_if_exists=True)
        self.distributions = {p.key: _distribution(optuna, p) for p in params}
        self.budget = budget
        self._lock = threading.Lock()
        running = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        self._interrupted = deque(self._trial(t.number, t.params) for t in running)

    @property
    def interrupted(self) -> list[Trial]:
        return list(self._interrupted)

    def next(self) -> Trial | None:
        with self._lock:
            if self._interrupted:
                return self._interrupted.popleft()
            if len(self.study.get_trials(deepcopy=False)) >= self.budget:
                return None
            asked = self.study.ask(self.distributions)
            return self._trial(asked.number, asked.params)

    def finish(self, trial: Trial, outcome: Outcome) -> None:
        state = self._optuna.trial.TrialState
        with self._lock:
            if outcome.value is None:
                self.study.tell(trial.index, state=state.FAIL, skip_if_finished=True)
            else:
                self.study.tell(trial.index, outcome.value, skip_if_finished=True)

    def trials(self) -> list[Trial]:
        """Every trial drawn so far, in order."""
        return [self._trial(t.number, t.params) for t in self.study.get_trials(deepcopy=False)]

    def _trial(self, number: int, values: dict) -> Trial:
        params = tuple((key, _text(values[key])) for key in self.distributions)
        return Trial(number, trial_name(number, params), params)


def _distribution(optuna, param: Param):
    distributions = optuna.distributions
    if param.kind == "loguniform":
        return distributions.FloatDistribution(param.low, param.high, log=True)
    if param.kind == "uniform":
        return distributions.FloatDistribution(param.low, param.high)
    if param.kind == "int":
        return distributions.IntDistribution(int(param.low), int(param.high))
    return distributions.CategoricalDistribution(param.values)  # override texts, so any YAML value can be a choice


def _text(value) -> str:
    return value if isinstance(value, str) else repr(value)  # repr: the shortest text that reads back the same float
