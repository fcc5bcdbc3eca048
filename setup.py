"""Build the Cython core of qwen_v3_calculator; everything else is declared in pyproject.toml."""
from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        "qwen_v3_calculator._core",
        ["calculator_cython/qwen_v3_calculator/_core.pyx"],
        extra_compile_args=["-O3"],
    )
]

setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"}))
