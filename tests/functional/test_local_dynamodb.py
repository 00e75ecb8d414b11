"""local.moto.dynamodb: a TransactWriteItems copies the items it names, not its whole table, and DynamoDB behaves as
before: a transaction writes all of its items or, when one of its conditions fails, none."""

from __future__ import annotations

from typing import Any

import boto3
import pytest

from local.moto import patch
from local.moto.patches import applied


def table() -> Any:
    ddb = boto3.client("dynamodb", region_name="us-east-1")
    ddb.create_table(TableName="t", BillingMode="PAY_PER_REQUEST",
                     KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"},
                                {"AttributeName": "sk", "KeyType": "RANGE"}],
                     AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"},
                                           {"AttributeName": "sk", "AttributeType": "S"}])
    return ddb


def put(sk: str, **extra: Any) -> dict[str, Any]:
    op: dict[str, Any] = {"TableName": "t", "Item": {"pk": {"S": "run"}, "sk": {"S": sk}, "n": {"N": "1"}}}
    return {"Put": op | extra}


def counter_up(condition: str = "attribute_exists(pk)") -> dict[str, Any]:
    return {"Update": {"TableName": "t", "Key": {"pk": {"S": "run"}, "sk": {"S": "count"}},
                       "UpdateExpression": "ADD n :one", "ConditionExpression": condition,
                       "ExpressionAttributeValues": {":one": {"N": "1"}}}}


def item(ddb: Any, sk: str) -> dict[str, Any] | None:
    return ddb.get_item(TableName="t", Key={"pk": {"S": "run"}, "sk": {"S": sk}}).get("Item")


def test_a_transaction_copies_the_items_it_names_not_the_table(aws: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a table of 300 items, and moto's item copies counted
    from moto.dynamodb.models.dynamo_type import Item

    ddb = table()
    for i in range(300):
        ddb.put_item(TableName="t", Item={"pk": {"S": "run"}, "sk": {"S": f"p#{i:03d}"}})
    ddb.put_item(TableName="t", Item={"pk": {"S": "run"}, "sk": {"S": "count"}, "n": {"N": "300"}})
    copies = []
    copied = Item.__deepcopy__
    monkeypatch.setattr(Item, "__deepcopy__", lambda self, memo: copies.append(1) or copied(self, memo))
    # When a participant is registered: its record and the count, in one transaction
    ddb.transact_write_items(TransactItems=[put("p#new", ConditionExpression="attribute_not_exists(pk)"),
                                            counter_up()])
    # Then only the two items it names were copied (moto copied all 301), and both were written
    assert len(copies) <= 2
    assert item(ddb, "p#new") is not None and item(ddb, "count")["n"] == {"N": "301"}


@pytest.mark.parametrize("failing", ["condition", "validation"])
def test_a_transaction_that_fails_writes_none_of_its_items(aws: None, failing: str) -> None:
    # Given a table with a count, and a transaction whose first operation would write a new record and whose second
    # fails (its condition, or it names the first's item again)
    ddb = table()
    ddb.put_item(TableName="t", Item={"pk": {"S": "run"}, "sk": {"S": "count"}, "n": {"N": "5"}})
    ddb.put_item(TableName="t", Item={"pk": {"S": "run"}, "sk": {"S": "p#old"}, "n": {"N": "7"}})
    second = counter_up("n < :one") if failing == "condition" else put("p#new")
    items = [put("p#new"), {"Delete": {"TableName": "t", "Key": {"pk": {"S": "run"}, "sk": {"S": "p#old"}}}}, second]
    # When it is sent
    with pytest.raises(ddb.exceptions.ClientError):
        ddb.transact_write_items(TransactItems=items)
    # Then nothing it named changed: no new record, the deleted one is back, the count as it was
    assert item(ddb, "p#new") is None
    assert item(ddb, "p#old") == {"pk": {"S": "run"}, "sk": {"S": "p#old"}, "n": {"N": "7"}}
    assert item(ddb, "count")["n"] == {"N": "5"}


def test_the_local_server_serves_query_results_uncopied(aws: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a table of 300 participant records and 5 other items, copies of their values counted, and what a Query of
    # the records returns as moto has it
    from moto.dynamodb.models.dynamo_type import DynamoType

    ddb = table()
    for i in range(300):
        ddb.put_item(TableName="t", Item={"pk": {"S": "run"}, "sk": {"S": f"p#{i:03d}"}, "n": {"N": str(i)}})
    for i in range(5):
        ddb.put_item(TableName="t", Item={"pk": {"S": "run"}, "sk": {"S": f"u#{i}"}})

    def records() -> list[dict[str, Any]]:
        pages = ddb.get_paginator("query").paginate(
            TableName="t", KeyConditionExpression="pk = :pk AND begins_with(sk, :p)",
            ExpressionAttributeValues={":pk": {"S": "run"}, ":p": {"S": "p#"}})
        return [i for page in pages for i in page["Items"]]

    before = records()
    copies = []
    copied = DynamoType.__deepcopy__
    monkeypatch.setattr(DynamoType, "__deepcopy__", lambda self, memo: copies.append(1) or copied(self, memo))
    # When the local server's patch is applied (for the test: only the local server serves so) and the records queried
    # again
    with applied([patch("dynamodb_query_results_uncopied")]):
        after = records()
    # Then the same items come back, and none was copied (moto copied every one)
    assert after == before and len(after) == 300
    assert copies == []



def test_a_query_sorts_the_table_on_its_key_values(aws: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a run's 1,000 participant records and 2,000 update records in its one partition, put in no order, and
    # another run's items; comparisons of moto's key objects counted (each casts both values again)
    from moto.dynamodb.models.dynamo_type import DynamoType

    ddb = table()
    participants = [f"p#{i:04d}" for i in range(1000)]
    keys = participants + [f"u#{r}#{i:04d}" for r in range(2) for i in range(1000)]
    for n, sk in enumerate(sorted(keys, key=lambda k: hash(k) % 7919)):
        ddb.put_item(TableName="t", Item={"pk": {"S": "run"}, "sk": {"S": sk}, "n": {"N": str(n)}})
    for i in range(10):
        ddb.put_item(TableName="t", Item={"pk": {"S": "other"}, "sk": {"S": f"p#{i}"}})
    comparisons = []
    less = DynamoType.__lt__
    monkeypatch.setattr(DynamoType, "__lt__", lambda a, b: comparisons.append(1) or less(a, b))
    # When the participant records are queried
    pages = ddb.get_paginator("query").paginate(
        TableName="t", KeyConditionExpression="pk = :pk AND begins_with(sk, :p)",
        ExpressionAttributeValues={":pk": {"S": "run"}, ":p": {"S": "p#"}})
    got = [i["sk"]["S"] for page in pages for i in page["Items"]]
    # Then they come in key order, and the query compared key objects at most once per item of the partition (moto
    # sorted the whole table by comparing them: ~35,000 comparisons here)
    assert got == participants
    assert len(comparisons) < 2 * len(keys)


def test_every_kind_of_attribute_value_comes_back_as_it_was_put(aws: None) -> None:
    # Given an item with an attribute of every kind, nested in a map and a list too (local.moto.dynamodb writes
    # attribute values itself, not through moto's generic serializer)
    ddb = table()
    scalars = {"s": {"S": "text é"}, "empty": {"S": ""}, "n": {"N": "-12.50"}, "b": {"B": b"\x00\xffbytes"},
               "ss": {"SS": ["a", "b"]}, "ns": {"NS": ["1", "2.5"]}, "bs": {"BS": [b"\x01", b"\x02"]},
               "yes": {"BOOL": True}, "no": {"BOOL": False}, "null": {"NULL": True}}
    item = {"pk": {"S": "run"}, "sk": {"S": "everything"}, **scalars,
            "m": {"M": {**scalars, "inner": {"M": {"l": {"L": [{"N": "1"}, {"B": b"x"}]}}}}},
            "l": {"L": [{"M": scalars}, {"L": []}, {"M": {}}, *scalars.values()]}}
    ddb.put_item(TableName="t", Item=item)
    # When it is read back by key and by a query
    got = ddb.get_item(TableName="t", Key={"pk": {"S": "run"}, "sk": {"S": "everything"}})["Item"]
    queried = ddb.query(TableName="t", KeyConditionExpression="pk = :pk",
                        ExpressionAttributeValues={":pk": {"S": "run"}})["Items"]
    # Then both are the item as put (sets in any order)

    def canonical(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: sorted(v) if k in ("SS", "NS", "BS") else canonical(v) for k, v in value.items()}
        return [canonical(v) for v in value] if isinstance(value, list) else value

    assert canonical(got) == canonical(item)
    assert [canonical(i) for i in queried] == [canonical(item)]
