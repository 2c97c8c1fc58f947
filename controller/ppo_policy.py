"""Serve an SB3 PPO zip without SB3: read it safely, check it fits, evaluate its MLP directly.

Why not ``PPO.load(...).predict``: ``load`` unpickles the zip's ``data`` (arbitrary code from a
file), and ``predict`` costs ≈200 µs per call here against ≈5 µs for the same small matrix products in
numpy, ≈2.5 µs compiled with numba (:meth:`MLP.act`, :func:`mlp_logits`). So the loader reads only

- ``specdepth.json`` — our own metadata, written next to SB3's files by
  :func:`write_metadata` (``controller train`` does it): the allowed depths, the Featurizer
  version, ``obs_dim`` and feature names, the net architecture and activation;
- ``data`` — SB3's JSON, parsed as JSON only (its ``:serialized:`` pickles are never
  touched), to cross-check the observation and action space sizes;
- ``policy.pth`` — the state dict, with ``torch.load(weights_only=True)``.

A zip trained for other depths, a Featurizer version this controller no longer computes
(:data:`~controller.features.SUPPORTED_VERSIONS`) or another observation size is refused with a
:class:`~controller.errors.PolicyLoadError` that says what differs. A zip of an older supported
version is served with that version's observation (:func:`~controller.features.featurizer_for`).

The served action is the deterministic one (``predict(obs, deterministic=True)``): the argmax
of the policy head's logits.
"""

from __future__ import annotations

import io
import json
import logging
import math
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from controller._jit import JIT_ENABLED, maybe_njit_reassoc, njit_uncached
from controller.errors import ControllerError, PolicyLoadError
from controller.features import FEATURIZER_VERSION, SUPPORTED_VERSIONS, Featurizer, fuse, warm_up
from controller.objective import THROUGHPUT, parse_objective
from controller.protocol import Step

META_NAME: Final = "specdepth.json"
META_FORMAT: Final = 1
ACTIVATIONS: Final = ("tanh", "relu")
MAX_ZIP_MEMBER_BYTES: Final = 64 * 1024 * 1024  # a 2×64 policy is ~50 KB; refuse zip bombs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PPOMeta:
    """What a PPO zip was trained for; stored as ``specdepth.json`` inside the zip.

    Attributes:
        depths: the allowed draft depths; action i means depth ``depths[i]``.
        featurizer_version: :data:`controller.features.FEATURIZER_VERSION` at training.
        obs_dim: length of one Featurizer observation.
        feature_names: the Featurizer's names, one per observation entry.
        net_arch: hidden layer widths of the policy MLP.
        activation: ``"tanh"`` or ``"relu"``.
        frame_stack: how many consecutive observations (oldest first) form the MLP input.
        extra: free-form training provenance (seed, timesteps, sim), not checked.
        model_table: the fitted latency model the policy was trained with, as a table
            ``[depth][bs grid][ctx grid]`` of log(step time at that depth / at depth 0) over
            :data:`MODEL_BS_GRID` × :data:`MODEL_CTX_GRID` (the observation's ``bs`` and
            ``ctx_per_req`` features); the MLP input then carries :func:`model_features`
            after the observation. The bs grid is read from the table (any number of even
            steps over the same range), so zips with the older 19-point grid still load.
            None: the observation alone (older zips).
        objective: what the policy was trained for, as ``--objective`` spells it
            (:mod:`controller.objective`: ``throughput`` or ``slo:TPOT_MS``); zips from before
            the key existed were trained for throughput.
    """

    depths: tuple[int, ...]
    featurizer_version: int
    obs_dim: int
    feature_names: tuple[str, ...]
    net_arch: tuple[int, ...]
    activation: str = "tanh"
    frame_stack: int = 1
    extra: dict[str, Any] | None = None
    model_table: tuple[tuple[tuple[float, ...], ...], ...] | None = None
    objective: str = THROUGHPUT

    @property
    def input_dim(self) -> int:
        """Entries of one frame of the MLP input: the observation, plus the model features."""
        return self.obs_dim + (2 * len(self.depths) if self.model_table is not None else 0)

    def to_json(self) -> str:
        extra_keys: dict[str, Any] = {}
        if self.model_table is not None:
            extra_keys["model_table"] = [[list(row) for row in t] for t in self.model_table]
        return json.dumps(
            {
                "format": META_FORMAT,
                "depths": list(self.depths),
                "featurizer_version": self.featurizer_version,
                "obs_dim": self.obs_dim,
                "feature_names": list(self.feature_names),
                "net_arch": list(self.net_arch),
                "activation": self.activation,
                "frame_stack": self.frame_stack,
                "objective": self.objective,
                "extra": self.extra or {},
                **extra_keys,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> PPOMeta:
        try:
            raw = json.loads(text)
            if raw.get("format") != META_FORMAT:
                raise PolicyLoadError(
                    f"{META_NAME} has format {raw.get('format')!r}; this controller reads format {META_FORMAT}"
                )
            meta = cls(
                depths=tuple(int(d) for d in raw["depths"]),
                featurizer_version=int(raw["featurizer_version"]),
                obs_dim=int(raw["obs_dim"]),
                feature_names=tuple(str(n) for n in raw["feature_names"]),
                net_arch=tuple(int(w) for w in raw["net_arch"]),
                activation=str(raw.get("activation", "tanh")),
                frame_stack=int(raw.get("frame_stack", 1)),
                extra=dict(raw.get("extra") or {}),
                model_table=_table(raw.get("model_table")),
                objective=str(raw.get("objective", THROUGHPUT)),
            )
        except PolicyLoadError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise PolicyLoadError(f"{META_NAME} is malformed: {type(exc).__name__}: {exc}") from None
        if meta.activation not in ACTIVATIONS:
            raise PolicyLoadError(f"{META_NAME}: activation {meta.activation!r} is not one of {ACTIVATIONS}")
        if meta.frame_stack < 1:
            raise PolicyLoadError(f"{META_NAME}: frame_stack must be ≥ 1, got {meta.frame_stack}")
        try:
            parse_objective(meta.objective)
        except ControllerError as exc:
            raise PolicyLoadError(f"{META_NAME}: objective: {exc}") from None
        if meta.model_table is not None:
            got = (
                len(meta.model_table),
                len(meta.model_table[0]) if meta.model_table else 0,
                len(meta.model_table[0][0]) if meta.model_table and meta.model_table[0] else 0,
            )
            # The bs grid's size is the zip's own (model_features reads it from the table).
            nd, nb, nc = len(meta.depths), got[1], len(MODEL_CTX_GRID)
            if (
                got[0] != nd
                or nb < 2
                or any(len(t) != nb or any(len(r) != nc for r in t) for t in meta.model_table)
            ):
                raise PolicyLoadError(
                    f"{META_NAME}: model_table has shape {got}, expected ({nd}, ≥ 2 batch sizes, {nc})"
                )
        return meta


def _table(raw: Any) -> tuple[tuple[tuple[float, ...], ...], ...] | None:
    if raw is None:
        return None
    return tuple(tuple(tuple(float(v) for v in row) for row in t) for t in raw)


# --------------------------------------------------------------------------- model features

# Grids of the model table, in the observation's own units: ``bs`` (``encode_bs`` of the batch
# size: batch 1 … ~512) and ``ctx_per_req`` (``encode_ctx`` of ctx/bs: 0 … 32k tokens), both in
# controller.features.
# 145 batch-size points (a step of 0.0078) price every batch size up to 12 exactly and the
# rest to 32 within 4.4%: a drafted step's cost jumps from one batch size to the next where the
# verify's extend kernel starts another wave of requests (``env.latency._extend_kernel``: every
# ~4 on the H200 fits), and with 19 points (before) the h200-llama8b table interpolated depth
# 5's cost at batch 8 between batches 7 and 10, 4-7% above the fit's, which kept a policy at
# depth 0 for seconds after the drafter turned good (docs/results.md, "Why PPO trailed
# goodput-fit").
MODEL_BS_GRID: Final = tuple(i * 1.125 / 144 for i in range(145))
MODEL_CTX_GRID: Final = tuple(i / 10 for i in range(11))


def model_table_array(table: Any) -> np.ndarray:
    """A model table (:attr:`PPOMeta.model_table`) as a contiguous float64 array."""
    return np.ascontiguousarray(np.asarray(table, dtype=np.float64))


def model_inputs(depths: Sequence[int]) -> np.ndarray:
    """Where the model features read the observation: the indices of ``bs``,
    ``ctx_per_req`` and each ``tokens_k``, and each depth + 1 (an int64 array)."""
    names = Featurizer(depths).feature_names
    idx = [names.index("bs"), names.index("ctx_per_req")]
    idx += [names.index(f"tokens_{d}") for d in depths]
    idx += [int(d) + 1 for d in depths]
    return np.asarray(idx, dtype=np.int64)


@maybe_njit_reassoc
def _interp(grid_step: float, n: int, x: float) -> tuple[int, float]:
    u = x / grid_step
    if u <= 0.0:
        return 0, 0.0
    if u >= n - 1:
        return n - 2, 1.0
    i = int(u)
    return i, u - i


@maybe_njit_reassoc
def model_features(obs: np.ndarray, table: np.ndarray, inputs: np.ndarray) -> np.ndarray:
    """The MLP input of a policy with a model table: ``obs`` then, per depth k, the fitted
    model's log(step time at k / at 0) for this batch size and context (interpolated in the
    table, ±2) and the model's expected goodput at k relative to depth 0,
    log(tokens_k·(k+1) / that time ratio) (±2) — what ``goodput-fit`` maximises."""
    nd = table.shape[0]
    nb, nc = table.shape[1], table.shape[2]
    out = np.empty(len(obs) + 2 * nd, dtype=np.float32)
    for i in range(len(obs)):
        out[i] = obs[i]
    ib, fb = _interp(1.125 / (nb - 1), nb, obs[inputs[0]])
    ic, fc = _interp(1.0 / (nc - 1), nc, obs[inputs[1]])
    o = len(obs)
    for k in range(nd):
        lat = (
            table[k, ib, ic] * (1.0 - fb) * (1.0 - fc)
            + table[k, ib + 1, ic] * fb * (1.0 - fc)
            + table[k, ib, ic + 1] * (1.0 - fb) * fc
            + table[k, ib + 1, ic + 1] * fb * fc
        )
        tok = max(float(obs[inputs[2 + k]]) * inputs[2 + nd + k], 1e-6)
        g = math.log(tok) - lat
        out[o + k] = min(max(lat, -2.0), 2.0)
        out[o + nd + k] = min(max(g, -2.0), 2.0)
    return out


def meta_for(
    depths: Sequence[int],
    net_arch: Sequence[int],
    activation: str = "tanh",
    frame_stack: int = 1,
    extra: dict[str, Any] | None = None,
    model_table: Any = None,
    objective: str = THROUGHPUT,
    featurizer_version: int = FEATURIZER_VERSION,
) -> PPOMeta:
    """The metadata of a policy trained on this checkout's Featurizer (``featurizer_version``
    of it) for ``depths`` (with a fitted model's table, :attr:`PPOMeta.model_table`, when
    given) for ``objective``."""
    feat = Featurizer(depths, featurizer_version)
    return PPOMeta(
        depths=tuple(int(d) for d in depths),
        featurizer_version=featurizer_version,
        obs_dim=feat.obs_dim,
        feature_names=tuple(feat.feature_names),
        net_arch=tuple(int(w) for w in net_arch),
        activation=activation,
        frame_stack=frame_stack,
        extra=extra,
        model_table=_table(model_table.tolist() if isinstance(model_table, np.ndarray) else model_table),
        objective=str(parse_objective(objective)),
    )


def write_metadata(zip_path: str | Path, meta: PPOMeta) -> None:
    """Add (or replace) ``specdepth.json`` in an SB3 zip saved by ``model.save``."""
    zip_path = Path(zip_path)
    with zipfile.ZipFile(zip_path) as zf:
        members = {name: zf.read(name) for name in zf.namelist() if name != META_NAME}
    tmp = zip_path.with_suffix(zip_path.suffix + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(META_NAME, meta.to_json())
    tmp.replace(zip_path)


# --------------------------------------------------------------------------- reading


def _read_member(zf: zipfile.ZipFile, name: str, path: Path) -> bytes:
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise PolicyLoadError(f"{path}: no {name} inside the zip") from None
    if info.file_size > MAX_ZIP_MEMBER_BYTES:
        raise PolicyLoadError(f"{path}: {name} is {info.file_size} bytes, more than a policy can be")
    return zf.read(name)


def _space_sizes(data: dict[str, Any]) -> tuple[int | None, int | None]:
    """Observation length and action count from SB3's ``data`` JSON, reading only plain fields."""
    obs_dim = n_actions = None
    obs = data.get("observation_space")
    if isinstance(obs, dict):
        shape = obs.get("_shape")
        if isinstance(shape, list) and len(shape) == 1:
            obs_dim = int(shape[0])
    act = data.get("action_space")
    if isinstance(act, dict) and "n" in act:
        try:
            n_actions = int(str(act["n"]))
        except ValueError:
            pass
    return obs_dim, n_actions


class MLP:
    """The policy head of an SB3 ``ActorCriticPolicy`` (MlpPolicy), evaluated by :func:`mlp_logits`.

    Args:
        weights: ``(W, b)`` per hidden layer, then the action head, as float32 arrays with
            ``W`` of shape (out, in) like ``torch.nn.Linear``.
        activation: ``"tanh"`` or ``"relu"`` for the hidden layers.
    """

    def __init__(self, weights: list[tuple[np.ndarray, np.ndarray]], activation: str) -> None:
        # Every layer as (out, in + 1) float32, its bias the last column: the form mlp_logits reads.
        self._layers = tuple(
            np.ascontiguousarray(np.hstack([w, b[:, None]]), dtype=np.float32) for w, b in weights
        )
        self._relu = activation == "relu"
        # Compiled (numba) unless numba is off or cannot build it; then the same source runs as
        # plain Python (the same arithmetic, far slower: ~2 ms a decision for a 2x64 net).
        self._compiled = JIT_ENABLED
        if self._compiled:
            try:  # compile now (or load numba's cache), not on the first decision
                _mlp_argmax(np.zeros(self._layers[0].shape[1] - 1, np.float32), self._layers, self._relu)
            except Exception as exc:
                log.warning(
                    "cannot compile the policy MLP (%s: %s); serving it uncompiled", type(exc).__name__, exc
                )
                self._compiled = False

    def argmax_kernel(
        self, model: tuple[np.ndarray, np.ndarray] | None = None
    ) -> Callable[[np.ndarray], int] | None:
        """A compiled ``obs -> action`` with this MLP's weights built in as constants, for
        :func:`controller.features.fuse`; None without numba. Compiles in this process
        (~0.4 s together with the fused kernel), so call it once per loaded policy.

        ``model``: ``(table, inputs)`` of a policy with a model table: the kernel appends
        :func:`model_features` to the observation first."""
        if not self._compiled:
            return None
        layers, relu = self._layers, self._relu
        if model is None:

            def argmax(x: np.ndarray) -> int:
                return _mlp_argmax(x, layers, relu)

            return njit_uncached(argmax)
        table, inputs = model

        def argmax_model(x: np.ndarray) -> int:
            return _mlp_argmax(model_features(x, table, inputs), layers, relu)

        return njit_uncached(argmax_model)

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Action logits for one observation (1-D) or a batch (2-D, one row each)."""
        x = np.asarray(x, dtype=np.float32)
        forward = mlp_logits if self._compiled else _plain(mlp_logits)
        rows = [np.ascontiguousarray(row) for row in np.atleast_2d(x)]
        out = np.stack([forward(row, self._layers, self._relu) for row in rows])
        return out[0] if x.ndim == 1 else out

    def act(self, x: np.ndarray) -> int:
        """The deterministic action for one observation: argmax of :func:`mlp_logits`.

        This runs once per decode step of every instance: one compiled call, 2.4 µs at p50 on
        the development box. It picks SB3's ``predict`` action (tests/test_ppo_policy.py).
        """
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
        if self._compiled:
            return _mlp_argmax(x, self._layers, self._relu)
        return int(np.argmax(_plain(mlp_logits)(x, self._layers, self._relu)))


def _plain(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """The plain-Python source of a compiled kernel (the kernel itself when numba is off)."""
    return getattr(kernel, "py_func", kernel)


# tanh on float32 as a rational function, Eigen's ``generic_fast_tanh_float`` (its minimax
# coefficients): arithmetic only, so the activation loop runs in SIMD lanes, where a call to
# the C library's tanh per unit cost more than the layer's dot products. Largest error against
# float64 tanh over [-10, 10]: 2.7e-7 (tests/test_ppo_policy.py holds it under 5e-7). It is the
# one tanh of the served MLP, compiled or not.
_TANH_P = (
    -2.76076847742355e-16,
    2.00018790482477e-13,
    -8.60467152213735e-11,
    5.12229709037114e-08,
    1.48572235717979e-05,
    6.37261928875436e-04,
    4.89352455891786e-03,
)
_TANH_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)


@maybe_njit_reassoc
def tanh32(v: Any) -> Any:
    """tanh of a float32 by a rational approximation (see ``_TANH_P``), kept within [-1, 1]."""
    v = min(max(v, np.float32(-9.0)), np.float32(9.0))
    v2 = v * v
    p = np.float32(_TANH_P[0])
    for c in _TANH_P[1:]:
        p = p * v2 + np.float32(c)
    q = np.float32(_TANH_Q[0])
    for c in _TANH_Q[1:]:
        q = q * v2 + np.float32(c)
    return min(max(v * p / q, np.float32(-1.0)), np.float32(1.0))


@maybe_njit_reassoc
def mlp_logits(x: np.ndarray, layers: tuple[np.ndarray, ...], relu: bool) -> np.ndarray:
    """The policy MLP's forward pass, written once: float32 logits of one observation.

    ``layers`` hold (out, in + 1) float32 weights, bias last (:class:`MLP`); hidden layers use
    relu or :func:`tanh32`. Each layer in two passes, the dot products then the activation, so
    both run in SIMD lanes when compiled (dot products summed in any order: last-bit
    differences from a strict sum, as BLAS has too).
    """
    h = x
    last = len(layers) - 1
    for k in range(last + 1):
        w = layers[k]
        n_out, n_in = w.shape[0], w.shape[1] - 1
        out = np.empty(n_out, dtype=np.float32)
        for j in range(n_out):
            acc = w[j, n_in]
            for i in range(n_in):
                acc += h[i] * w[j, i]
            out[j] = acc
        if k < last:
            if relu:
                for j in range(n_out):
                    out[j] = max(out[j], np.float32(0.0))
            else:
                for j in range(n_out):
                    out[j] = tanh32(out[j])
        h = out
    return h


@maybe_njit_reassoc
def _mlp_argmax(x: np.ndarray, layers: tuple[np.ndarray, ...], relu: bool) -> int:
    """:meth:`MLP.act` compiled: the argmax of :func:`mlp_logits`."""
    return int(np.argmax(mlp_logits(x, layers, relu)))


def policy_net_layers(sd: Mapping[str, Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The actor of an SB3 MlpPolicy state dict, in order: ``(W, b)`` of each
    ``mlp_extractor.policy_net.<i>`` Linear, then of ``action_net``, as float32 numpy arrays.

    Raises:
        KeyError: a layer's ``weight`` or ``bias`` is missing (its name is the key).
    """
    hidden = sorted(
        int(k.split(".")[2])
        for k in sd
        if k.startswith("mlp_extractor.policy_net.") and k.endswith(".weight")
    )
    names = [f"mlp_extractor.policy_net.{i}" for i in hidden] + ["action_net"]
    layers: list[tuple[np.ndarray, np.ndarray]] = []
    for name in names:
        w, b = sd.get(f"{name}.weight"), sd.get(f"{name}.bias")
        if w is None or b is None:
            raise KeyError(name)
        layers.append((w.detach().cpu().float().numpy(), b.detach().cpu().float().numpy()))
    return layers


def _load_weights(sd: dict[str, Any], meta: PPOMeta, path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    try:
        layers = policy_net_layers(sd)
    except KeyError as exc:
        raise PolicyLoadError(
            f"{path}: policy.pth has no {exc.args[0]}.weight/bias (not an SB3 MlpPolicy?)"
        ) from None
    widths = tuple(w.shape[0] for w, _ in layers[:-1])
    if widths != meta.net_arch:
        raise PolicyLoadError(
            f"{path}: policy.pth has hidden widths {list(widths)}, {META_NAME} says {list(meta.net_arch)}"
        )
    in_dim = layers[0][0].shape[1]
    if in_dim != meta.input_dim * meta.frame_stack:
        raise PolicyLoadError(
            f"{path}: the policy's input has {in_dim} entries, but its input ({meta.input_dim}: obs_dim "
            f"{meta.obs_dim} + model features) × frame_stack {meta.frame_stack} = {meta.input_dim * meta.frame_stack}"
        )
    for (w_prev, _), (w, _) in zip(layers, layers[1:]):
        if w.shape[1] != w_prev.shape[0]:
            raise PolicyLoadError(
                f"{path}: policy.pth layer shapes do not chain ({w_prev.shape} then {w.shape})"
            )
    n_out = layers[-1][0].shape[0]
    if n_out != len(meta.depths):
        raise PolicyLoadError(
            f"{path}: the action head has {n_out} outputs for {len(meta.depths)} depths {list(meta.depths)}"
        )
    return layers


def read_ppo_zip(path: str | Path) -> tuple[PPOMeta, MLP]:
    """Read a PPO zip without unpickling anything; raises :class:`PolicyLoadError`.

    Checks that the zip is internally consistent (metadata vs SB3's spaces vs the weights);
    checking it against a live Featurizer and depths is :func:`check_compatible`'s job.
    """
    path = Path(path)
    if not path.is_file():
        raise PolicyLoadError(f"{path}: no such policy file")
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise PolicyLoadError(f"{path}: not a zip file ({exc})") from None
    with zf:
        if META_NAME not in zf.namelist():
            raise PolicyLoadError(
                f"{path}: no {META_NAME} inside, so its depths and Featurizer version are unknown; "
                "train it with `controller train` (or add the metadata with controller.ppo_policy.write_metadata)"
            )
        meta = PPOMeta.from_json(_read_member(zf, META_NAME, path))
        try:
            data = json.loads(_read_member(zf, "data", path))
        except ValueError:
            raise PolicyLoadError(f"{path}: SB3's data member is not JSON") from None
        pth = _read_member(zf, "policy.pth", path)
    obs_dim, n_actions = _space_sizes(data if isinstance(data, dict) else {})
    if obs_dim is not None and obs_dim != meta.input_dim * meta.frame_stack:
        raise PolicyLoadError(
            f"{path}: SB3's observation space has {obs_dim} entries, {META_NAME} says "
            f"{meta.input_dim} × frame_stack {meta.frame_stack}"
        )
    if n_actions is not None and n_actions != len(meta.depths):
        raise PolicyLoadError(
            f"{path}: SB3's action space has {n_actions} actions for depths {list(meta.depths)}"
        )
    import torch  # lazily: `controller --help` and builtin policies do not need torch

    try:
        sd = torch.load(io.BytesIO(pth), map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only raises UnpicklingError for anything but tensors
        raise PolicyLoadError(
            f"{path}: policy.pth is not a plain tensor state dict ({type(exc).__name__})"
        ) from None
    if not isinstance(sd, dict):
        raise PolicyLoadError(f"{path}: policy.pth does not hold a state dict")
    return meta, MLP(_load_weights(sd, meta, path), meta.activation)


def check_compatible(meta: PPOMeta, depths: Sequence[int], where: str = "policy") -> None:
    """Refuse a policy whose depths, Featurizer version or observation differ from this
    checkout's Featurizer for ``depths``; the message lists every difference."""
    depths = tuple(int(d) for d in depths)
    problems: list[str] = []
    if meta.depths != depths:
        problems.append(f"trained for depths {list(meta.depths)}, the instance allows {list(depths)}")
    if meta.featurizer_version not in SUPPORTED_VERSIONS:
        problems.append(
            f"trained on Featurizer version {meta.featurizer_version}, this controller runs versions "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}"
        )
    if not problems:
        feat = Featurizer(depths, meta.featurizer_version)
        if meta.obs_dim != feat.obs_dim:
            problems.append(f"observations of {meta.obs_dim} entries, the Featurizer makes {feat.obs_dim}")
        elif tuple(feat.feature_names) != meta.feature_names:
            diff = [
                f"{i}: {a!r} vs {b!r}"
                for i, (a, b) in enumerate(zip(meta.feature_names, feat.feature_names))
                if a != b
            ]
            problems.append(f"feature names differ at {', '.join(diff[:3])}")
    if problems:
        raise PolicyLoadError(f"{where} does not fit: " + "; ".join(problems))


class PPOPolicy:
    """A loaded PPO MLP behind the :class:`controller.policy.Policy` interface.

    Stateless unless ``frame_stack > 1``, in which case it keeps the last observations of its
    own instance (one policy object per instance, made by the factory).

    Attributes:
        fused: after :meth:`PPOFactory.prepare_serving`, a kernel that featurizes and acts in
            one compiled call: ``featurizer.update_with(step, policy.fused)`` is
            ``policy.act(featurizer.update(step), step)``, the same state and the same action.
            None otherwise (and for stacked frames, which keep their stack in Python).
    """

    def __init__(self, name: str, mlp: MLP, meta: PPOMeta, fused: Callable[..., int] | None = None) -> None:
        self.name = name
        self.meta = meta
        self.featurizer_version = meta.featurizer_version  # controller.policy.VersionedPolicy
        self._mlp = mlp
        self._k = meta.frame_stack
        self._stack: np.ndarray | None = None
        self.fused = fused if self._k == 1 else None
        self._table = model_table_array(meta.model_table) if meta.model_table is not None else None
        self._inputs = model_inputs(meta.depths)
        self._features = model_features if JIT_ENABLED else _plain(model_features)

    def reset(self) -> None:
        self._stack = None

    def _input(self, obs: np.ndarray) -> np.ndarray:
        if self._table is None:
            return obs
        return self._features(np.asarray(obs, dtype=np.float32), self._table, self._inputs)  # type: ignore[no-any-return]

    def act(self, obs: np.ndarray, step: Step) -> int:
        obs = self._input(obs)
        if self._k == 1:
            return self._mlp.act(obs)
        n = self.meta.input_dim
        if self._stack is None:
            # Like a frame-stacking wrapper at reset: the first observation fills every slot.
            self._stack = np.tile(np.asarray(obs, dtype=np.float32), self._k)
        else:
            self._stack[:-n] = self._stack[n:]
            self._stack[-n:] = obs
        return self._mlp.act(self._stack)

    def logits(self, obs: np.ndarray) -> np.ndarray:
        """Logits of one observation (frame_stack 1 only); for tests and diagnostics."""
        return self._mlp.logits(self._input(obs))


class PPOFactory:
    """Makes one :class:`PPOPolicy` per instance, all sharing the loaded weights."""

    def __init__(self, path: Path, meta: PPOMeta, mlp: MLP) -> None:
        self.path = path
        self.meta = meta
        self.name = f"ppo:{path.name}"
        self.objective = meta.objective
        # What its policies observe; `controller serve` says it at start.
        self.featurizer_version = meta.featurizer_version
        self._mlp = mlp
        self._fused: Callable[..., int] | None = None

    def prepare_serving(self) -> None:
        """Build the fused Featurizer + MLP kernel that policies made from now on decide with
        (see :attr:`PPOPolicy.fused`): ~0.4 s, once; ``controller serve`` calls it before it
        binds. Without numba, for stacked frames, or if it cannot be built (logged), policies
        take the two-call path, which decides the same."""
        if self._fused is not None or self.meta.frame_stack != 1:
            return
        try:
            consume = self._mlp.argmax_kernel(
                None
                if self.meta.model_table is None
                else (model_table_array(self.meta.model_table), model_inputs(self.meta.depths))
            )
            fused = fuse(consume) if consume is not None else None
            if fused is not None:  # compile now, not on the first decision
                warm_up(fused, self.meta.depths)
        except Exception as exc:
            log.warning(
                "cannot compile the fused policy kernel (%s: %s); serving in two calls",
                type(exc).__name__,
                exc,
            )
            return
        self._fused = fused

    def __call__(self, depths: tuple[int, ...]) -> PPOPolicy:
        check_compatible(self.meta, depths, where=str(self.path))
        return PPOPolicy(self.name, self._mlp, self.meta, self._fused)


def load_ppo_factory(path: str | Path, depths: Sequence[int] | None = None) -> PPOFactory:
    """Load a PPO zip for serving; raises :class:`PolicyLoadError` with what is wrong.

    Args:
        path: an SB3 PPO zip written by ``controller train`` (with ``specdepth.json``).
        depths: when given, the zip must have been trained for exactly these depths.

    Returns:
        A factory making one policy per instance; it refuses instances whose ``hello``
        announces other depths.
    """
    path = Path(path)
    meta, mlp = read_ppo_zip(path)
    # The Featurizer version and observation layout must match whatever the depths are.
    check_compatible(meta, meta.depths if depths is None else depths, where=str(path))
    return PPOFactory(path, meta, mlp)


__all__ = [
    "MODEL_BS_GRID",
    "MODEL_CTX_GRID",
    "META_NAME",
    "MLP",
    "PPOFactory",
    "PPOMeta",
    "PPOPolicy",
    "check_compatible",
    "load_ppo_factory",
    "meta_for",
    "mlp_logits",
    "model_features",
    "model_inputs",
    "model_table_array",
    "policy_net_layers",
    "read_ppo_zip",
    "write_metadata",
]
