"""moto's DynamoDB, as the local stack runs it (`PATCHES`): costs that do not grow with the table, and its answers
written directly. What a request does, and refuses, is moto's unchanged: every patch here is for speed."""

from __future__ import annotations

import base64
import copy
import threading
from typing import Any

from local.moto.patches import SPEED, Patch, argument

_state = threading.local()


def _transaction_backs_up_its_items(table_deepcopy: Any, transact: Any) -> tuple[object, ...]:
    """Table.__deepcopy__ (moto's Table has none: deepcopy's default), DynamoDBBackend.transact_write_items."""
    from moto.dynamodb.models.dynamo_type import DynamoType

    def table_copy(self: Any, memo: dict[int, Any]) -> Any:
        """The whole table, as deepcopy makes it; within a transaction, the table itself (its items are backed up)."""
        if getattr(_state, "transacting", False):
            return self
        new = object.__new__(type(self))
        memo[id(self)] = new
        for name, value in vars(self).items():
            new.__dict__[name] = copy.deepcopy(value, memo)
        return new

    def touched(backend: Any, transact_items: list[dict[str, Any]]) -> list[tuple[Any, Any, Any, Any]]:
        """(table, hash key, range key, a copy of the item or None) for each item the transaction names."""
        saved = []
        for entry in transact_items:
            for op in entry.values():
                table = backend.tables.get(op.get("TableName")) if isinstance(op, dict) else None
                if table is None:
                    continue
                key = op.get("Key") or op.get("Item") or {}
                try:
                    hash_key = DynamoType(key[table.hash_key_attr])
                    range_key = DynamoType(key[table.range_key_attr]) if table.range_key_attr else None
                    item = table.get_item(hash_key, range_key)
                except Exception:  # a malformed key: moto refuses the transaction before writing anything
                    continue
                saved.append((table, hash_key, range_key, copy.deepcopy(item)))
        return saved

    def restore(saved: list[tuple[Any, Any, Any, Any]]) -> None:
        for table, hash_key, range_key, item in reversed(saved):
            if range_key is None:
                if item is None:
                    table.items.pop(hash_key, None)
                else:
                    table.items[hash_key] = item
            elif item is None:
                table.items.get(hash_key, {}).pop(range_key, None)
            else:
                table.items[hash_key][range_key] = item

    def transact_write_items(self: Any, transact_items: list[dict[str, Any]]) -> None:
        saved = touched(self, transact_items)
        _state.transacting = True
        try:
            transact(self, transact_items)
        except Exception:
            restore(saved)  # moto's own rollback put back the table object it "copied": the table itself
            raise
        finally:
            _state.transacting = False

    return table_copy, transact_write_items


def _sorted_on_key_values(all_items: Any) -> tuple[object, ...]:
    """Table.all_items."""

    def sorted_items(self: Any) -> list[Any]:
        """Every item in key order, as moto's, sorted on the keys' values rather than by comparing DynamoTypes."""
        if not self.range_key_attr:
            return sorted(self.items.values(), key=lambda item: item.hash_key.cast_value)
        items = [item for partition in self.items.values() for item in partition.values()]
        return sorted(items, key=lambda item: (item.hash_key.cast_value, item.range_key.cast_value))

    return (sorted_items,)


def _attribute_values_written_directly(structure: Any) -> tuple[object, ...]:
    """BaseJSONSerializer._serialize_type_structure."""

    def serialize_structure(self: Any, serialized: Any, value: Any, shape: Any, key: str) -> None:
        if shape.name != "AttributeValue" or not isinstance(value, dict):
            structure(self, serialized, value, shape, key)
            return
        wire = attribute_value(value)
        if key:
            self._default_serialize(serialized, wire, shape, key)
        else:
            serialized.update(wire)

    return (serialize_structure,)


def _query_results_uncopied(item_copy: Any, query: Any) -> tuple[object, ...]:
    """Item.__deepcopy__, Table.query."""
    index_name = argument(query, "index_name")

    def uncopied(self: Any, memo: dict[int, Any]) -> Any:
        return self if getattr(_state, "querying", False) else item_copy(self, memo)

    def table_query(self: Any, *args: Any, **kwargs: Any) -> Any:
        _state.querying = index_name((self, *args), kwargs) is None  # (a query of an index copies, as moto's)
        try:
            return query(self, *args, **kwargs)
        finally:
            _state.querying = False

    return uncopied, table_query


def attribute_value(value: dict[str, Any]) -> dict[str, Any]:
    """An attribute value as moto's serializer writes it ({"B": bytes} -> base64 text, numbers as text, maps and
    lists member by member), without looking each member up in the service model."""
    wire: dict[str, Any] = {}
    for kind, v in value.items():
        if v is None:
            continue
        if kind == "B":
            v = _base64(v)
        elif kind == "BS":
            v = [_base64(x) for x in v]
        elif kind == "M":
            v = {name: attribute_value(x) for name, x in v.items()}
        elif kind == "L":
            v = [attribute_value(x) for x in v]
        elif kind in ("S", "N"):
            v = str(v)
        elif kind in ("SS", "NS"):
            v = [str(x) for x in v]
        wire[kind] = v
    return wire


def _base64(value: str | bytes) -> str:
    return base64.b64encode(value.encode() if isinstance(value, str) else value).strip().decode()


PATCHES = (
    Patch(
        "dynamodb_transaction_backs_up_its_items", SPEED,
        ("moto.dynamodb.models.table:Table.__deepcopy__", "moto.dynamodb.models:DynamoDBBackend.transact_write_items"),
        "moto backs up, before every TransactWriteItems, each table the transaction names by deep-copying the whole "
        "table, so that it can roll back when an operation fails: a transaction cost time in proportion to the "
        "table. The run registers each participant in a transaction (the record and the run's participant count), "
        "so with a thousand joiners registration slowed as the table grew: at 1,000 participants a third of the "
        "local server's time went to those copies, and the join lane fell behind. This backs up only the items the "
        "transaction names, and puts those back when it fails, as DynamoDB's cost does not grow with the table.",
        _transaction_backs_up_its_items),
    Patch(
        "dynamodb_query_sorts_on_key_values", SPEED,
        ("moto.dynamodb.models.table:Table.all_items",),
        "A Query sorts the table's items as Python sorts numbers and strings. moto sorts every item of the table for "
        "each Query by comparing key objects that cast both their values again at each comparison: the run's items "
        "share one partition and grow by a thousand a round at 1,000 participants (an update record each), so the "
        "tick's queries held the local server's DynamoDB lock longer each round (py-spy: sorting there while "
        "ingest waited).",
        _sorted_on_key_values),
    Patch(
        "dynamodb_attribute_values_written_directly", SPEED,
        ("moto.core.serialize:BaseJSONSerializer._serialize_type_structure",),
        "A response's attribute values are written as moto's generic serializer writes them, without looking each "
        "one's every member up in the service model: a Query of 1,000 participant records took ~0.3 s to write, "
        "and writing DynamoDB responses was a third of the local server's interpreter (py-spy, a round at 1,000 "
        "participants).",
        _attribute_values_written_directly),
    Patch(
        "dynamodb_query_results_uncopied", SPEED,
        ("moto.dynamodb.models.dynamo_type:Item.__deepcopy__", "moto.dynamodb.models.table:Table.query"),
        "A Query on a table (not an index) returns the stored items themselves; moto deep-copies every item it "
        "returns. A tick queries every participant record, and at 1,000 participants those copies held the local "
        "server's DynamoDB lock long enough that requests queued behind it timed out and were sent again, until "
        "nothing else was served (py-spy: 842 requests waiting on the lock). For the local server only: there "
        "every DynamoDB request, its response included, is served under one lock (`local.server.SerialDynamoDB`), "
        "so nothing changes an item while its response is written.",
        _query_results_uncopied, server_only=True),
)
