"""Build hook: compile core/protos/*.proto into *_pb2.py before packaging.

The generated modules are not committed; every build (wheel, sdist install,
editable install) produces them with the protoc bundled in grpcio-tools.
"""

import glob
import os
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_DIR = os.path.join(HERE, "core", "protos")


def compile_protos() -> None:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as root:
        staged = os.path.join(root, "clusterwire", "protos")
        os.makedirs(staged)
        sources = sorted(glob.glob(os.path.join(PROTO_DIR, "*.proto")))
        for source in sources:
            shutil.copy(source, staged)
        include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
        args = ["protoc", f"-I{root}", f"-I{include}", f"--python_out={root}", f"--pyi_out={root}"]
        args += [os.path.join("clusterwire", "protos", os.path.basename(s)) for s in sources]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        for generated in glob.glob(os.path.join(staged, "*_pb2.py*")):
            shutil.copy(generated, PROTO_DIR)


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        compile_protos()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
