"""Where a run lives: bucket, table, endpoint. Read from a local connection file or a stack's outputs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import boto3

from shared.naming import (
    OUTPUT_BUCKET,
    OUTPUT_CREDENTIAL_ENDPOINT,
    OUTPUT_PARTICIPANT_ROLE,
    OUTPUT_RUN_ID,
    OUTPUT_STATE_TOPIC,
    OUTPUT_TABLE,
    OUTPUT_TICK_FUNCTION,
)

DEFAULT_LOCAL_FILE = Path(".fed") / "local.json"


class ConnectionError_(RuntimeError):
    pass


@dataclass(frozen=True)
class Connection:
    run_id: str
    bucket: str
    table: str
    endpoint: str | None = None  # None: AWS through the standard credential chain
    region: str = "us-east-1"
    participant_role: str = ""
    state_topic: str = ""  # SNS topic announcing new phases and rounds ("": none, the participant polls)
    tick_function: str = ""  # the deployed tick function (`fed run pause|resume` invoke it); "": local, or none
    credential_endpoint: str = ""  # where invited hosts get their sessions (`fed hosts invite` names it); "": none

    def save(self, path: Path = DEFAULT_LOCAL_FILE) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path = DEFAULT_LOCAL_FILE) -> Connection:
        try:
            return cls(**json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise ConnectionError_(
                f"{path} not found: start the local stack with `fed local` first, or name an AWS stack with --stack"
            ) from None

    @classmethod
    def from_stack(cls, stack: str, region: str | None = None) -> Connection:
        """Read the run's names from a deployed stack's outputs."""
        cfn = boto3.client("cloudformation", region_name=region)
        stacks = cfn.describe_stacks(StackName=stack)["Stacks"]
        outputs = {o["OutputKey"]: o["OutputValue"] for o in stacks[0].get("Outputs", [])}
        missing = [k for k in (OUTPUT_BUCKET, OUTPUT_TABLE, OUTPUT_RUN_ID) if k not in outputs]
        if missing:
            raise ConnectionError_(f"stack {stack} has no output {', '.join(missing)}: is it a fed run stack?")
        return cls(
            run_id=outputs[OUTPUT_RUN_ID],
            bucket=outputs[OUTPUT_BUCKET],
            table=outputs[OUTPUT_TABLE],
            endpoint=None,
            region=cfn.meta.region_name,
            participant_role=outputs.get(OUTPUT_PARTICIPANT_ROLE, ""),
            state_topic=outputs.get(OUTPUT_STATE_TOPIC, ""),
            tick_function=outputs.get(OUTPUT_TICK_FUNCTION, ""),
            credential_endpoint=outputs.get(OUTPUT_CREDENTIAL_ENDPOINT, ""),
        )
