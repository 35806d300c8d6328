"""FedBCGD: federated block coordinate gradient descent (Liu et al., MM'24; docs/algorithms.md, FedBCGD).

The parameters are split into N blocks x_(1..N) and a shared block x_s (usually the classifier).
Each round the S sampled clients are divided into N client-blocks (paper section 3.1, Fig. 2, Alg. 1 line 6);
client k of client-block j trains the WHOLE model from x (no freezing, unless the ``freezing`` ablation is on)
and uploads only y_(j) and y_s. Server, per block, heavy-ball momentum::

    v_(j) <- lambda v_(j) + mean_{owners of j} (y_(j) - x_(j));   x_(j) <- x_(j) + v_(j)
    v_s   <- lambda v_s   + mean_{all S}       (y_s - x_s);       x_s   <- x_s   + v_s

(a block without owners this round only applies lambda v). N = 1 is FedAvgM (heavy-ball, uniform);
additionally lambda = 0 is uniform FedAvg.

Dealing (:func:`assign_blocks`, ``algorithm.fedbcgd.dealing``). The paper takes |S| = N K and gives every
client-block K clients; |S| need not be a multiple of N here (a ``fixed`` sampler with any share, or the
``bernoulli`` sampler, whose |S| varies by round). The round's clients are shuffled (keyed by seed and round)
and dealt round-robin from a start block p_r: the client at shuffled position t owns block (p_r + t) mod N, so
every block gets floor(|S|/N) or ceil(|S|/N) owners and the m_r = |S| mod N extra owners go to the blocks
p_r, ..., p_r + m_r - 1 (mod N).

- ``balanced`` (default): p_r = m_r (s + r - 1) mod N with s = derive_seed("fedbcgd_dealing", seed) mod N, a
  cyclic pointer advanced by |S| mod N each round from a seeded start. With constant |S| the extra owners of
  consecutive rounds go to consecutive blocks, so over any run of rounds no block has more than one owner more
  than another (equal counts every N / gcd(m, N) rounds), and with |S| < N the rounds r .. r + ceil(N/|S|) - 1
  cover ceil(N/|S|) |S| >= N consecutive blocks: every block is updated at least once in every ceil(N/|S|)
  rounds. With a varying |S| (``bernoulli``, drawn independently of the round) the arc of a round with m extra
  owners starts at a multiple of gcd(m, N) that cycles with the round, so every block has the same expected
  number of owners, E|S|/N per round.
  The pointer is derived from (seed, round, |S|), not kept as state: the client must know its block, and a
  stateful pointer would have to be broadcast with the model each round (one more downlink float, one more
  tensor in every RoundContext); the derived one needs nothing, resumes from any checkpoint bit for bit, equals
  the stateful pointer whenever |S| is constant, and when m_r = 0 (|S| a multiple of N, the paper's setting)
  it is the ``round_robin`` dealing exactly.
- ``round_robin``: p_r = 0, the extra owners always go to the low blocks and, with |S| < N, blocks
  |S| + 1 .. N are never updated. It is the repository's LeNet-5 dealing ([BC] ``FedBCGD.py``, the main loop
  under ``if __name__ == "__main__"``: the slot list ``[block1, ..., block5] * 2``, unshuffled, zipped with the
  shuffled clients); its ResNet-18 path shuffles that list instead. Both give every block exactly
  |S|/N = 2 owners in the repository's setting (|S| = 10, N = 5).

Communication: up #x_(j) + #x_s per client, down d. The round's mean uplink per participating client is
(1/|S|) sum_j c_j #x_(j) + #x_s (c_j the owners of block j); with ``balanced`` E[c_j] = |S|/N for every block,
so its expectation is (d - #x_s)/N + #x_s (:meth:`FedBCGD.comm_floats`; exact every round when |S| is a
multiple of N). Block partitions: the paper's tables for the standard CNN ("LeNet-5", Table 7), VGG-11
(Table 8), ResNet-18 (Table 9), VGG-19 (Table 10) and ViT-B (section 5.2 and Table 11, N = 6), the repository's
LeNet partition (``code``), or ``units``: the model's units without the classifier dealt into N contiguous groups.
Ablations: ``shared=False`` (the classifier joins the last block), ``momentum=False`` (lambda = 0),
``freezing=True`` (clients update only their block and the shared block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..lazy import lazy_import
from ..schema import ConfigError, check_choice, checked, param, when
from ..seeding import derive_seed, torch_generator
from .base import Algorithm, Needs, ServerStep
from .registry import Rule, refuse_local_adam, refuse_local_momentum, register
from .scaffold import MOMENTUM_WHY, add_drift_correction

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch


DEALINGS = ("balanced", "round_robin")


@dataclass
class FedBCGDParams:
    """``algorithm.fedbcgd``: shared by FedBCGD and FedBCGD+."""

    # 0, as the presets: a composition that loads another preset (algorithm=qsgd algorithm.name=fedbcgd) fits the model
    blocks: int = param(0, "N parameter blocks besides the shared block; 0: as many as the model has (its paper "
                        "table's N, else one per unit besides the classifier)", ge=0)
    lam: float = param(0.8, "lambda: per-block server heavy-ball momentum (paper best ~0.8; code 0.45)", ge=0, lt=1,
                       when=when("algorithm.fedbcgd.momentum", True), replica=True)
    block_partition: str = param("auto", "auto (the model's paper table if it has N blocks, else units) | paper | "
                                 "code | units", choices=("auto", "paper", "code", "units"))
    shared: bool = param(True, "false: ablation 'nonshare', the classifier joins the last block")
    momentum: bool = param(True, "false: ablation lambda = 0")
    freezing: bool = param(False, "ablation: clients update only their block and the shared block")
    plus_variant: str = param("paper", "FedBCGD+ only: paper (SVRG + full-batch control variates) | code "
                              "(SCAFFOLD II + momentum)", choices=("paper", "code"),
                              when=when("algorithm.name", "fedbcgd_plus"))
    dealing: str = param("balanced", "clients to blocks: balanced (floor/ceil(|S|/N) owners each, the extra owners "
                         "rotating from a seeded start) | round_robin (the extra owners always to the low blocks; the "
                         "repository's LeNet-5 dealing)", choices=DEALINGS)

# parameter-name prefixes: (blocks, shared), by model class
BLOCK_TABLES: Dict[str, Dict[str, Tuple[List[List[str]], List[str]]]] = {
    "StandardCNN": {
        "paper": ([["conv1"], ["conv2"], ["fc1"], ["fc2"]], ["fc3"]),  # FedBCGD Table 7 (4 blocks + shared fc3)
        "code": ([["conv1"], ["conv2"], ["fc1"], [], []], ["fc2", "fc3"]),  # FedBCGD.py main loop
    },
    # FedBCGD sec. 5.3 / Fig. 8: N = 5 coordinate blocks of x (the model stores x as 5 chunks), no shared block
    "BinaryLogisticRegression": {"paper": ([["x.0"], ["x.1"], ["x.2"], ["x.3"], ["x.4"]], [])},
    "ResNet18GN": {
        "paper": ([["conv1", "bn1", "layer1"], ["layer2"], ["layer3"], ["layer4.0"], ["layer4.1"]], ["fc"]),  # Table 9
    },
    # VGGs with the repository's head fc1 (512 -> h) + classifier fc2 (h -> C) (docs/algorithms.md, Model catalogue
    # and FedBCGD blocks). The tables' conv rows are matched layer by layer; their FC rows ("FC-2048" x2 in Block 5,
    # shared "FC-100") do not fit that head, so Block 5 gets the hidden FC fc1 and the shared block the classifier
    # fc2. No "code" table: the repository's FedBCGD.py does not wire VGG in.
    "VGG11": {  # Table 8: two convs per block
        "paper": ([["conv1", "conv2"], ["conv3", "conv4"], ["conv5", "conv6"], ["conv7", "conv8"], ["fc1"]],
                  ["fc2"]),
    },
    "VGG19": {  # Table 10: the eight 64..256 convs, then two 512 convs per block, Block 5 with the hidden FC
        "paper": ([[f"conv{i}" for i in range(1, 9)], ["conv9", "conv10"], ["conv11", "conv12"],
                   ["conv13", "conv14"], ["conv15", "conv16", "fc1"]], ["fc2"]),
    },
}
# ViT-B/16 (section 5.2, Table 5: N = 6; Table 11) and vit_tiny, which has its 12-layer layout: two encoder layers per
# block, the embeddings in Block 1, the final LayerNorm in Block 6, the head shared. Table 11's equal blocks of
# 14,299,520 are no whole-layer grouping (docs/algorithms.md, FedBCGD blocks, has ours against them).
_VIT_LAYERS = [[f"encoder.layers.encoder_layer_{i}" for i in (j, j + 1)] for j in range(0, 12, 2)]
_VIT_TABLE = ([["conv_proj", "class_token", "encoder.pos_embedding", *_VIT_LAYERS[0]], *_VIT_LAYERS[1:5],
               [*_VIT_LAYERS[5], "encoder.ln"]], ["heads.head"])
BLOCK_TABLES.update({"ViTB16": {"paper": _VIT_TABLE}, "ViTTiny": {"paper": _VIT_TABLE}})


def _match(name: str, prefixes: Sequence[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def block_partition(model: torch.nn.Module, names: Sequence[str], num_blocks: int, kind: str = "auto",
                    shared: bool = True) -> Tuple[List[List[int]], List[int]]:
    """Parameter indices (ParamSpec order) of each of the N blocks and of the shared block.

    ``num_blocks`` = 0 takes as many blocks as the model has: the N of its table (``paper`` for ``auto``), else one
    block per unit besides the classifier.

    Raises:
        ValueError: a table that does not exist for the model, a table of another size than
            ``algorithm.fedbcgd.blocks``, or a partition that does not cover every parameter once.
        ConfigError: ``units`` (or ``auto`` without a matching table) with more blocks than the model has units
            besides the classifier, which would leave blocks empty.
    """
    table = BLOCK_TABLES.get(type(model).__name__, {})
    units = model.units() if hasattr(model, "units") else [list(names)]
    requested = num_blocks
    if num_blocks == 0:  # as many as the model has: its paper table's N, else one block per unit but the classifier
        table_kind = "paper" if kind == "auto" else kind
        if kind != "units" and table_kind in table:
            num_blocks = len(table[table_kind][0])
        else:
            num_blocks = max(1, len(units) - 1)
    if kind == "auto":
        kind = "paper" if "paper" in table and len(table["paper"][0]) == num_blocks else "units"
    if kind in ("paper", "code"):
        if kind not in table:
            raise ValueError(f"algorithm.fedbcgd.block_partition={kind}: no such table for {type(model).__name__} "
                             f"(tables exist for {', '.join(BLOCK_TABLES)}; use units)")
        prefixes, shared_prefixes = table[kind]
        if len(prefixes) != num_blocks:
            raise ValueError(f"algorithm.fedbcgd.blocks must be {len(prefixes)} for the {kind} table of "
                             f"{type(model).__name__}, got {num_blocks}")
        blocks = [[i for i, n in enumerate(names) if _match(n, pre)] for pre in prefixes]
        shared_idx = [i for i, n in enumerate(names) if _match(n, shared_prefixes)]
    else:
        index = {n: i for i, n in enumerate(names)}
        body, head = units[:-1], units[-1]
        groups = np.array_split(np.arange(len(body)), num_blocks)
        blocks = [[index[n] for u in g for n in body[u]] for g in groups]
        shared_idx = [index[n] for n in head]
    if not shared:
        blocks[-1] = sorted(blocks[-1] + shared_idx)
        shared_idx = []
    empty = [j + 1 for j, b in enumerate(blocks) if not b]
    if empty and kind != "code":  # the code table's empty blocks are the repository's layout (5 blocks, 3 filled)
        have = len(units) - 1
        fix = (f"use algorithm.fedbcgd.blocks <= {have}" if have > 0 else
               "use a model with several units or algorithm.fedbcgd.shared=false")
        raise ConfigError(f"algorithm.fedbcgd.blocks={requested} leaves block(s) {', '.join(map(str, empty))} empty: "
                          f"{type(model).__name__} has {have} units besides the classifier; {fix}")
    seen = sorted(i for b in blocks for i in b) + sorted(shared_idx)
    if sorted(seen) != list(range(len(names))) or len(seen) != len(set(seen)):
        raise ValueError("algorithm.fedbcgd.block_partition must cover every parameter exactly once")
    return blocks, shared_idx


def deal_start(num_sampled: int, num_blocks: int, seed: int, round_idx: int, dealing: str = "balanced") -> int:
    """The start block p_r in [0, N) of round ``round_idx`` (1-indexed): the block of the first shuffled client.

    ``balanced``: p_r = m (s + r - 1) mod N with m = |S| mod N and s = derive_seed("fedbcgd_dealing", seed) mod N
    (module docstring, Dealing); ``round_robin``: 0.

    Raises:
        ConfigError: ``dealing`` not one of ``balanced``, ``round_robin`` (names ``algorithm.fedbcgd.dealing``).
    """
    check_choice("algorithm.fedbcgd.dealing", dealing, DEALINGS)
    m = int(num_sampled) % int(num_blocks)
    if dealing == "round_robin" or m == 0:
        return 0
    s = derive_seed("fedbcgd_dealing", int(seed)) % num_blocks
    return (m * (s + int(round_idx) - 1)) % num_blocks


def assign_blocks(sampled: Sequence[int], num_blocks: int, seed: int, round_idx: int,
                  dealing: str = "balanced") -> List[List[int]]:
    """Client ids of each of the N client-blocks in round ``round_idx`` (paper section 3.1, Alg. 1 line 6).

    The clients are shuffled (keyed by seed and round) and the one at shuffled position t owns block
    (p_r + t) mod N, p_r = :func:`deal_start`; every block gets floor(|S|/N) or ceil(|S|/N) owners (module
    docstring, Dealing). A pure function of (sampled, N, seed, round, dealing): no state, so a resumed run deals
    as the uninterrupted one.

    Returns:
        N lists of client ids (each in shuffled order); together they hold ``sampled`` exactly once.

    Raises:
        ConfigError: an unknown ``dealing`` (names ``algorithm.fedbcgd.dealing``).
    """
    start = deal_start(len(sampled), num_blocks, seed, round_idx, dealing)
    g = torch_generator("fedbcgd", seed, round_idx)
    order = torch.randperm(len(sampled), generator=g).tolist()
    owners: List[List[int]] = [[] for _ in range(num_blocks)]
    for t, i in enumerate(order):
        owners[(start + t) % num_blocks].append(int(sampled[i]))
    return owners


class FedBCGD(Algorithm):
    """FedBCGD (paper section 3.1, Alg. 1; module docstring and docs/algorithms.md, FedBCGD).

    ``blocks``: N lists of parameter indices (ParamSpec order), ``shared``: those of x_s (:func:`block_partition`);
    server state v [d]; clients are stateless. Each client uploads its block and the shared block
    (``ClientUpdate.sent["delta"]`` = #x_(j) + #x_s floats); its block comes from :func:`assign_blocks` with
    ``dealing``.

    Raises:
        ConfigError: ``lam`` outside [0, 1) or an unknown ``dealing`` (one line naming the key).
    """

    name = "fedbcgd"

    def __init__(self, spec, blocks: List[List[int]], shared: List[int], lam: float = 0.8, momentum: bool = True,
                 freezing: bool = False, dealing: str = "balanced"):
        self.num_blocks = len(blocks)
        checked(FedBCGDParams, "algorithm.fedbcgd", lam=float(lam), dealing=dealing)
        self.dealing = dealing
        self.lam = float(lam) if momentum else 0.0
        self.freezing = freezing
        self.block_params = blocks
        self.shared_params = shared
        d = spec.d
        self.block_masks = []
        for b in blocks:
            m = torch.zeros(d, dtype=torch.bool)
            for i in b:
                m[spec.offsets[i]:spec.offsets[i] + spec.numels[i]] = True
            self.block_masks.append(m)
        self.shared_mask = torch.zeros(d, dtype=torch.bool)
        for i in shared:
            self.shared_mask[spec.offsets[i]:spec.offsets[i] + spec.numels[i]] = True
        self.shared_floats = int(self.shared_mask.sum())
        self._assign_cache: Tuple[Optional[tuple], List[List[int]]] = (None, [])

    def shown(self):
        return (("N", self.num_blocks), ("lambda", f"{self.lam:g}"))

    def _owners(self, rctx) -> List[List[int]]:
        key = (rctx.seed, rctx.round, rctx.sampled)
        if self._assign_cache[0] != key:
            self._assign_cache = (key, assign_blocks(rctx.sampled, self.num_blocks, rctx.seed, rctx.round,
                                                     self.dealing))
        return self._assign_cache[1]

    def _block_of(self, rctx, client_id: int) -> int:
        return next(j for j, o in enumerate(self._owners(rctx)) if client_id in o)

    def init_server_state(self, global_flat):
        return {"v": torch.zeros_like(global_flat)}

    def client_begin(self, ctx, probe):
        """With freezing, only the client's block (and the shared tensors) move at every step (``ctx.step_mask``)."""
        if not self.freezing:
            return
        j = self._block_of(ctx.round, ctx.client_id)
        allowed = set(self.block_params[j]) | set(self.shared_params)
        mask = [i in allowed for i in range(len(ctx.round.spec.names))]
        ctx.step_mask = lambda k: mask

    def finish_client(self, ctx, update):
        j = self._block_of(ctx.round, ctx.client_id)
        keep = (self.block_masks[j] | self.shared_mask).to(update.delta.device)
        update.delta = torch.where(keep, update.delta, torch.zeros_like(update.delta))
        update.extra["block"] = torch.tensor(j)  # bookkeeping: the server deals the blocks itself, nothing is sent
        update.sent["delta"] = float(keep.sum())  # y_(j) and y_s
        return update

    def aggregate(self, rctx, server_state, updates):
        dev = rctx.global_flat.device
        by_client = {u.client_id: u.delta for u in updates}
        step = torch.zeros_like(rctx.global_flat)
        for j, owners in enumerate(self._owners(rctx)):
            got = [by_client[c] for c in owners if c in by_client]
            if got:
                mask = self.block_masks[j].to(dev)
                step = torch.where(mask, torch.stack(got).mean(0), step)
        if self.shared_floats:
            shared = self.shared_mask.to(dev)
            step = torch.where(shared, torch.stack(list(by_client.values())).mean(0), step)
        v = self.lam * server_state["v"] + step
        return ServerStep(rctx.global_flat + v, {"v": v})

    def comm_floats(self, d):
        """(up, down) floats per participating client per round: ((d - #x_s)/N + #x_s, d). The uplink is the
        expectation over the dealing (``balanced``: every block has |S|/N owners in expectation); a round's
        measured uplink (``ClientUpdate.sent``) equals it when |S| is a multiple of N."""
        return (d - self.shared_floats) / self.num_blocks + self.shared_floats, float(d)


class FedBCGDPlus(FedBCGD):
    """FedBCGD+ (docs/algorithms.md, FedBCGD+): FedBCGD's block upload and per-block server momentum plus control
    variates.

    ``variant="paper"`` (paper Eq. 4 / Alg. 3): client k holds c_k [d], the server c [d]. Before its steps the
    client computes the full-batch gradient g_full = grad f_k(x) at the received model x; every step uses, on
    the same mini-batch xi (signs as in SVRG and SCAFFOLD, see docs/algorithms.md, FedBCGD+)::

        v = grad f_k(y; xi) - grad f_k(x; xi) + g_full - c_k + c;      y <- y - eta v
        c_k+ = g_full;   upload y_(j), y_s and Delta c = (c_k+ - c_up_k) on block j and the shared block

    server: model and momentum exactly as FedBCGD, then c <- c + (1/M) sum_{i in S} Delta c_i (M = all
    clients; each Delta c_i is zero outside its client's block and the shared block, so block j moves by
    the sum over its owners and the shared block by the sum over all sampled clients). c_up_k is c_k as the
    server knows it: the values last uploaded for each coordinate (docs/algorithms.md, FedBCGD+). The paper's
    Delta c = c_k+ - c_k on a block breaks SCAFFOLD's invariant c = (1/M) sum_k c_k, because c_k is
    overwritten on every coordinate but uploaded on one block: the server then accumulates differences to
    values it never received (on digits, errors of |g|/M per participation, as large as c itself). With
    c_up_k the invariant c = (1/M) sum_k c_up_k holds exactly (tested); the local correction uses c_k.

    ``variant="code"`` (the repository's ``FedBCGD+``, SCAFFOLD option II + block upload + momentum): steps
    ``y <- y - eta (g + c - c_k)``; after the K_i steps c_k+ = c_k - c + (x - y) / (K_i eta); upload
    s_k = c_k+ - c on block j and the shared block; server c_(j) <- c_(j) + p mean_{owners of j} s_k and
    c_s <- c_s + p mean_{all S} s_k with p = |S| / M (an EMA of the clients' c_k+ with weight p).

    In both variants c_k is overwritten on every coordinate (the paper's Alg. 3). The code variant's c_k+ assumes
    plain local SGD steps; it refuses ``train.momentum`` > 0 (the paper variant's c_k+ = g_full does not depend on
    the local steps). Communication: up
    2 (#x_(j) + #x_s) (model block + Delta c block), down 2d (x and c); state: c_k per client, c and v.
    """

    name = "fedbcgd_plus"

    def __init__(self, spec, blocks, shared, lam: float = 0.8, momentum: bool = True, freezing: bool = False,
                 variant: str = "paper", dealing: str = "balanced"):
        checked(FedBCGDParams, "algorithm.fedbcgd", plus_variant=variant)
        super().__init__(spec, blocks, shared, lam=lam, momentum=momentum, freezing=freezing, dealing=dealing)
        self.variant = variant
        self.needs = Needs(full_gradient=variant == "paper", anchor_gradient=variant == "paper")
        # QSGD (compression.py) quantises these uploads too, each as a message of its own
        self.compressed_extras = ("delta_c",)

    def shown(self):
        return (("", self.variant), ("N", self.num_blocks), ("lambda", f"{self.lam:g}"))

    def init_server_state(self, global_flat):
        return {"v": torch.zeros_like(global_flat), "c": torch.zeros_like(global_flat)}

    def init_client_state(self, global_flat):
        if self.variant == "paper":  # c_k, and c_up: c_k as the server knows it (the blocks it was last sent)
            return {"c": torch.zeros_like(global_flat), "c_up": torch.zeros_like(global_flat)}
        return {"c": torch.zeros_like(global_flat)}

    def broadcast(self, server_state):
        return {"c": server_state["c"]}

    def local_step(self, ctx, k, params, grads):
        if self.variant == "paper":  # the SVRG term first: g(y; xi) - g(x; xi) + g_full
            full = ctx.round.spec.views(ctx.full_grad)
            for n, g in grads.items():
                g.add_(full[n] - ctx.anchor_grads[n])
        add_drift_correction(ctx, grads)  # + c - c_k

    def finish_client(self, ctx, update):
        c_old = ctx.state["c"]
        if self.variant == "paper":
            c_new = ctx.full_grad.to(c_old.dtype)
            sent = c_new - ctx.state["c_up"]
        elif update.num_steps == 0:
            c_new, sent = c_old, torch.zeros_like(c_old)
        else:
            c = ctx.round.extra["c"]
            c_new = c_old - c - update.delta / (update.num_steps * ctx.round.lr)
            sent = c_new - c
        ctx.state["c"] = c_new
        update = super().finish_client(ctx, update)
        j = int(update.extra["block"])
        keep = (self.block_masks[j] | self.shared_mask).to(sent.device)
        update.extra["delta_c"] = torch.where(keep, sent, torch.zeros_like(sent))
        update.sent["delta_c"] = float(keep.sum())
        if self.variant == "paper":
            ctx.state["c_up"] = torch.where(keep, c_new, ctx.state["c_up"])
        return update

    def aggregate(self, rctx, server_state, updates):
        result = super().aggregate(rctx, server_state, updates)
        state, c = result.state, server_state["c"]
        if self.variant == "paper":
            c = c + torch.stack([u.extra["delta_c"] for u in updates]).sum(0) / rctx.num_clients
        else:
            dev = c.device
            by_client = {u.client_id: u.extra["delta_c"] for u in updates}
            step = torch.zeros_like(c)
            for j, owners in enumerate(self._owners(rctx)):
                got = [by_client[o] for o in owners if o in by_client]
                if got:
                    step = torch.where(self.block_masks[j].to(dev), torch.stack(got).mean(0), step)
            if self.shared_floats:
                step = torch.where(self.shared_mask.to(dev), torch.stack(list(by_client.values())).mean(0), step)
            c = c + (len(updates) / rctx.num_clients) * step
        state["c"] = c
        return result

    def comm_floats(self, d):
        up, _ = super().comm_floats(d)
        return 2.0 * up, 2.0 * float(d)


def _blocks(p, ctx):
    return block_partition(ctx.model, ctx.spec.names, p.blocks, p.block_partition, p.shared)


def _build_plus(p, ctx):
    if p.plus_variant == "code":
        refuse_local_momentum(ctx, "algorithm.fedbcgd.plus_variant=code", MOMENTUM_WHY)
        refuse_local_adam(ctx, "algorithm.fedbcgd.plus_variant=code", MOMENTUM_WHY)
    return FedBCGDPlus(ctx.spec, *_blocks(p, ctx), lam=p.lam, momentum=p.momentum, freezing=p.freezing,
                       variant=p.plus_variant, dealing=p.dealing)


register(Rule(
    name="fedbcgd", kind="base", label="FedBCGD", citation="Liu et al., ACM MM 2024, Alg. 1",
    summary="block-coordinate upload: each client sends one parameter block (plus a shared block); "
            "per-block server momentum lambda",
    params=FedBCGDParams, aggregation=("uniform",), eta_g=False,
    neutral=("algorithm.fedbcgd.blocks=1", "algorithm.fedbcgd.lam=0", "algorithm.fedbcgd.shared=true"),
    reference=("algorithm.name=fedavg", "algorithm.aggregation=uniform"),
    build=lambda p, ctx: FedBCGD(ctx.spec, *_blocks(p, ctx), lam=p.lam, momentum=p.momentum, freezing=p.freezing,
                                 dealing=p.dealing)))

register(Rule(
    name="fedbcgd_plus", kind="base", label="FedBCGD+", citation="Liu et al., ACM MM 2024, Alg. 3 and Eq. (4)",
    summary="FedBCGD with control variates (paper: SVRG with full-batch gradients; code: SCAFFOLD option II)",
    params=FedBCGDParams, section="fedbcgd", aggregation=("uniform",), eta_g=False,
    build=_build_plus))
