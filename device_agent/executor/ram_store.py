"""The RAM store: the tensors a schedule controls, with exact byte accounting.

A node's tensors (its outputs, plus what its backward saved; or, for a bwd node, the gradients it
produced) form one :class:`Entry`: a list of storages and views into them. Bytes are counted per
storage, so a storage shared by several tensors or entries is counted once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

StorageKey = tuple[int, int]  # (data pointer, bytes) of a live storage


def storage_key(tensor: torch.Tensor) -> StorageKey | None:
    """Identifies a tensor's storage while it is alive; None for empty storages."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    nbytes = storage.nbytes()
    if nbytes == 0:
        return None
    return storage.data_ptr(), nbytes


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


class TensorView(NamedTuple):
    """Where a tensor lives inside an entry: storage index, dtype, shape, stride and offset (in elements).

    A NamedTuple, not a dataclass: one is made for every tensor of every instruction, and this is cheaper.
    """

    storage_index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class Entry:
    """The tensors of one node: storages, and named views into them."""

    node: int
    storages: list[torch.UntypedStorage]
    views: dict[str, TensorView] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.storages)

    def tensor(self, name: str) -> torch.Tensor:
        return self.view_tensor(self.views[name])

    def view_tensor(self, view: TensorView) -> torch.Tensor:
        storage = self.storages[view.storage_index]
        return torch.empty(0, dtype=view.dtype).set_(storage, view.offset, view.shape, view.stride)

    def layout(self) -> EntryLayout:
        return EntryLayout(tuple(s.nbytes() for s in self.storages), dict(self.views))


@dataclass(frozen=True)
class EntryLayout:
    """An entry without its data: what a page file must restore."""

    storage_nbytes: tuple[int, ...]
    views: dict[str, TensorView]

    @property
    def nbytes(self) -> int:
        return sum(self.storage_nbytes)


class EntryBuilder:
    """Collects tensors into one entry, deduplicating storages (first seen, first indexed)."""

    def __init__(self, node: int):
        self.node = node
        self.storages: list[torch.UntypedStorage] = []
        self.views: dict[str, TensorView] = {}
        self._index: dict[StorageKey, int] = {}
        self._empty: dict[str, torch.Tensor] = {}

    def add(self, tensor: torch.Tensor) -> TensorView:
        key = storage_key(tensor)
        if key is None:  # empty storage: give it its own zero-byte slot
            storage = torch.empty(0, dtype=torch.uint8).untyped_storage()
            self.storages.append(storage)
            index = len(self.storages) - 1
        else:
            index = self._index.get(key)
            if index is None:
                self.storages.append(tensor.untyped_storage())
                index = self._index[key] = len(self.storages) - 1
        return TensorView(index, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())

    def add_named(self, name: str, tensor: torch.Tensor) -> TensorView:
        view = self.views[name] = self.add(tensor)
        return view

    def index_of(self, tensor: torch.Tensor) -> int | None:
        key = storage_key(tensor)
        return None if key is None else self._index.get(key)

    def build(self) -> Entry:
        return Entry(self.node, self.storages, self.views)


class RamStoreError(RuntimeError):
    """A store operation the schedule does not allow (a missing or duplicate entry)."""


class RamStore:
    """Entries by node, with per-storage reference counts so shared storage is counted once."""

    def __init__(self) -> None:
        self._entries: dict[int, Entry] = {}
        self._refs: dict[StorageKey, int] = {}
        # Storages the caller holds for the whole step (the batch): counted in the fixed bytes, never here.
        self.fixed_storages: frozenset[StorageKey] = frozenset()
        self.in_use_bytes = 0
        self.peak_bytes = 0
        self.timeline_bytes: list[int] = []  # in-use bytes after every put/drop

    def __contains__(self, node: int) -> bool:
        return node in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, node: int) -> Entry:
        try:
            return self._entries[node]
        except KeyError:
            raise RamStoreError(f"node {node} is not in RAM") from None

    def find(self, node: int) -> Entry | None:
        return self._entries.get(node)

    def nodes(self) -> list[int]:
        return list(self._entries)

    def holds_storage(self, tensor: torch.Tensor) -> bool:
        key = storage_key(tensor)
        return key is not None and key in self._refs

    def put(self, entry: Entry) -> int:
        """Store ``entry``; returns the bytes it added (storages already held by other entries are free)."""
        if entry.node in self._entries:
            raise RamStoreError(f"node {entry.node} is already in RAM")
        self._entries[entry.node] = entry
        added = 0
        for storage in entry.storages:
            nbytes = storage.nbytes()
            if nbytes == 0:
                continue
            key = (storage.data_ptr(), nbytes)
            count = self._refs.get(key, 0)
            if count == 0 and key not in self.fixed_storages:
                added += nbytes
            self._refs[key] = count + 1
        self._record(added)
        return added

    def drop(self, node: int) -> int:
        """Forget node's entry; returns the bytes released (storages no other entry holds)."""
        entry = self._entries.pop(node, None)
        if entry is None:
            raise RamStoreError(f"node {node} is not in RAM")
        released = 0
        for storage in entry.storages:
            nbytes = storage.nbytes()
            if nbytes == 0:
                continue
            key = (storage.data_ptr(), nbytes)
            count = self._refs[key] - 1
            if count == 0:
                del self._refs[key]
                if key not in self.fixed_storages:
                    released += nbytes
            else:
                self._refs[key] = count
        self._record(-released)
        return released

    def clear(self) -> None:
        self._entries.clear()
        self._refs.clear()
        self.in_use_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.in_use_bytes
        self.timeline_bytes = []

    def hold_workspace(self, workspace_bytes: int) -> int:
        """A computation that just ran also held ``workspace_bytes`` of temporaries: count them in the peak.

        Returns the tracked bytes at that moment (in use plus the workspace)."""
        held = self.in_use_bytes + workspace_bytes
        self.peak_bytes = max(self.peak_bytes, held)
        return held

    def _record(self, delta: int) -> None:
        self.in_use_bytes += delta
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        self.timeline_bytes.append(self.in_use_bytes)
