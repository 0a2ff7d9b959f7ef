"""``ZchEmbeddingBagCollection``: TorchRec's ``ManagedCollisionEmbeddingBagCollection`` on raw ids, as
one fused call: the zero-collision remap inside the embedding-bag lookup (``zch_embedding_bag``).

It takes the KJT of raw ids and returns ``(KeyedTensor, None)`` as the MC-EBC does. Each table's
features share one identity table. As TorchRec's MCH modules do, an id without a row reads the
table's last row (``unadmitted="default_row"``), so a table of ``num_embeddings`` rows holds
``num_embeddings - 1`` ids; ``unadmitted="zeros"`` drops such ids from their bag instead.

Differences from TorchRec's MCH, on purpose: ids are admitted and evicted on every training batch
(no ``eviction_interval``), a reused row gets the new id's fresh weights and zero fused-optimizer state
(TorchRec's MC-EBC ``evict()`` leaves the old row in place), and TTL and an admission threshold are
offered. ``state_dict()``: ``embedding_bags.<table>.weight`` (as ``FusedEmbeddingBagCollection``)
plus ``zch.*`` (identity tables, eviction metadata, hash index, admission counts, clock): loading it
restores the identity tables exactly. TorchRec's MC-EBC checkpoints (``_embedding_module.*``,
``_managed_collision_collection.*``) do not load into it; ``from_torchrec`` converts a live module.
"""

from __future__ import annotations

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import LFU_EvictionPolicy, LRU_EvictionPolicy, MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from ..nn.hashed_embedding_bag import UNADMITTED, hashed_lookup
from ..ops.zch import ZchTables
from .._swap import SwapSkip, register
from .embedding_modules import FusedEmbeddingBagCollection


class ZchEmbeddingBagCollection(FusedEmbeddingBagCollection):
    """``ebc(features) -> (KeyedTensor, None)``: features a KJT of raw int64 ids (any value), keys,
    order and pooling as TorchRec's EmbeddingBagCollection over the remapped ids.

    Args beyond ``FusedEmbeddingBagCollection``'s (tables, is_weighted, device, optimizer, backend):
    eviction, ttl, ttl_unit, admission_threshold, admission_capacity, max_probe (see
    ``gk.ZchTables``), unadmitted ("default_row" or "zeros"), seed (of the fresh rows). Fresh rows are
    uniform in each config's (weight_init_min, weight_init_max), TorchRec's default initialiser.
    ``timestamp`` (forward keyword) is the batch's time with ``ttl_unit="seconds"``.
    """

    def __init__(self, tables: list[EmbeddingBagConfig], is_weighted: bool = False, device=None, optimizer=None,
                 eviction: str = "lru", ttl: int | None = None, ttl_unit: str = "steps", admission_threshold: int = 1,
                 admission_capacity: int | None = None, max_probe: int = 32, unadmitted: str = "default_row",
                 seed: int = 0, backend: str | None = None):
        if unadmitted not in UNADMITTED:
            raise ValueError(f"unadmitted must be one of {UNADMITTED}, got {unadmitted!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
        super().__init__(tables, is_weighted=is_weighted, device=device, optimizer=optimizer,
                         bounds_check="skip" if unadmitted == "zeros" else "fatal", backend=backend)
        default_row = unadmitted == "default_row"
        rows = [c.num_embeddings for c in self._configs]
        if default_row and min(rows) < 2:
            raise ValueError(f"unadmitted 'default_row' needs num_embeddings >= 2 in every table, got {rows}")
        self.unadmitted, self.seed = unadmitted, seed
        self.zch = ZchTables([r - 1 if default_row else r for r in rows], eviction=eviction, ttl=ttl, ttl_unit=ttl_unit,
                             admission_threshold=admission_threshold, admission_capacity=admission_capacity,
                             max_probe=max_probe, device=device)
        bounds = [(c.get_weight_init_min(), c.get_weight_init_max()) for c in self._configs]
        self.register_buffer("init_bounds", torch.tensor(bounds, dtype=torch.float64, device=device), persistent=False)
        self._timestamp = None

    def _lookup(self, values, offsets, psw, pooling: str, batch: int) -> torch.Tensor:
        # The op's layout puts table t's bags (all its features) at t*K*B ... (t+1)*K*B: one id segment per table.
        return hashed_lookup(self, values, offsets, psw, pooling, self._timestamp)

    def forward(self, features: KeyedJaggedTensor, timestamp: int | None = None) -> tuple[KeyedTensor, None]:
        self._timestamp = timestamp
        try:
            return super().forward(features), None
        finally:
            self._timestamp = None

    @classmethod
    def from_torchrec(cls, module: ManagedCollisionEmbeddingBagCollection, optimizer=None,
                      backend: str | None = None, **kwargs) -> "ZchEmbeddingBagCollection":
        """The twin of a TorchRec MC-EBC with MCH modules: same configs and weights, LRU or LFU as its
        policies, and every id it holds keeps its row (its identity table is carried over; LFU counts
        restart at 1)."""
        if not isinstance(module, ManagedCollisionEmbeddingBagCollection):
            raise ValueError(f"module must be a torchrec ManagedCollisionEmbeddingBagCollection, got "
                             f"{type(module).__name__}")
        if module._return_remapped_features:
            raise ValueError("return_remapped_features=True is not supported (the remapped KJT is not returned)")
        ebc = module._embedding_module
        mcms = module._managed_collision_collection._managed_collision_modules
        policies = set()
        for name, mcm in mcms.items():
            if type(mcm) is not MCHManagedCollisionModule:
                raise ValueError(f"table {name!r}: only MCHManagedCollisionModule converts, got {type(mcm).__name__}")
            if mcm._input_hash_func is not None:
                raise ValueError(f"table {name!r}: an input_hash_func is not supported (ids are hashed here already)")
            if mcm._output_global_offset != 0:
                raise ValueError(f"table {name!r}: a sharded MCH module (output_global_offset "
                                 f"{mcm._output_global_offset}) does not convert")
            policy = {LRU_EvictionPolicy: "lru", LFU_EvictionPolicy: "lfu"}.get(type(mcm._eviction_policy))
            if policy is None:
                raise ValueError(f"table {name!r}: eviction policy {type(mcm._eviction_policy).__name__} has no "
                                 f"counterpart (LRU_EvictionPolicy and LFU_EvictionPolicy do)")
            policies.add(policy)
        if len(policies) != 1:
            raise ValueError(f"every table must use the same eviction policy, got {sorted(policies)}")
        configs = ebc.embedding_bag_configs()
        device = next(iter(ebc.embedding_bags.values())).weight.device
        new = cls(configs, is_weighted=ebc.is_weighted(), device=device, optimizer=optimizer,
                  eviction=policies.pop(), backend=backend, **kwargs)
        with torch.no_grad():
            for config in configs:
                new.weight(config.name).copy_(ebc.embedding_bags[config.name].weight)
            new._carry_identities([mcms[c.name] for c in configs])
        return new

    def _carry_identities(self, mcms) -> None:
        """Insert each MCH module's held ids (in the order of their rows) and move their rows along
        (one training call of the clock)."""
        segments, rows = [], []
        for mcm in mcms:
            held = mcm._mch_sorted_raw_ids[:-1] != torch.iinfo(torch.int64).max
            order = mcm._mch_remapped_ids_mapping[:-1][held].argsort()
            segments.append(mcm._mch_sorted_raw_ids[:-1][held][order])
            rows.append(mcm._mch_remapped_ids_mapping[:-1][held][order])
        ids = torch.cat(segments)
        id_offsets = torch.tensor([0] + [len(s) for s in segments], device=ids.device).cumsum(0)
        old = [self.weight(c.name).clone() for c in self._configs]
        slots = self.zch.remap(ids, id_offsets, train=True, default_row=self.unadmitted == "default_row",
                               backend=self.backend)
        for t, (c, seg_rows) in enumerate(zip(self._configs, rows)):
            start = int(id_offsets[t])
            mine = slots[start:start + len(seg_rows)]
            self.weight(c.name)[mine] = old[t][seg_rows]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", zch=({self.zch.extra_repr()}), unadmitted={self.unadmitted!r}"


def _convert_mc_ebc(module, *, optimizer, backend) -> ZchEmbeddingBagCollection:
    try:
        return ZchEmbeddingBagCollection.from_torchrec(module, optimizer=optimizer, backend=backend)
    except ValueError as exc:
        raise SwapSkip(str(exc)) from exc


register(ManagedCollisionEmbeddingBagCollection, _convert_mc_ebc)
