"""Run under the tinker SDK's venv: the SDK's own protobuf schema, serialized, for comparison with
the engine's (sess.engine.server.tinker.schema)."""

import base64
import json
import sys

from google.protobuf import descriptor_pb2
from tinker.proto import tinker_public_pb2

spec = json.loads(sys.argv[1])
proto = descriptor_pb2.FileDescriptorProto()
tinker_public_pb2.DESCRIPTOR.CopyToProto(proto)
with open(spec["out"], "w") as f:
    json.dump({"descriptor": base64.b64encode(proto.SerializeToString()).decode()}, f)
