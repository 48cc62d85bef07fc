"""The errors k3bundle raises for bad input.

Every error is one line that names the file or tensor and says what is wrong; the
CLI prints it as ``error: <message>`` and exits 2. Anything that is not a
``K3Error`` is a bug and keeps its traceback.
"""


class K3Error(Exception):
    """Base class: bad input or an impossible request, reported in one line."""

    exit_code = 2


class ConfigError(K3Error):
    """config.json is malformed: a field is missing, mistyped or impossible."""


class SchemaError(K3Error):
    """A checkpoint does not match the tensor schema of its config."""


class SafetensorsError(K3Error):
    """A safetensors file breaks the format (header, offsets, dtype, size)."""


class CodecError(K3Error):
    """A codec got input of the wrong shape, dtype or range."""


class SynthError(K3Error):
    """A synthetic checkpoint cannot be written as asked."""


class YamlFileError(K3Error):
    """A YAML data file is unreadable or not plain data: not UTF-8, a key given twice, an anchor
    used too often (an alias bomb), an explicit tag, a non-finite number (``k3bundle.io.strict_yaml``).
    ``problem`` is the message without the file; ``key`` the dotted place in the document, if any."""

    def __init__(self, file: str, problem: str, *, key: str | None = None):
        super().__init__(f"{file}: {problem}")
        self.file, self.problem, self.key = str(file), problem, key

    def __reduce__(self):  # the keyword field survives a trip between processes
        return _rebuild_yaml_error, (self.file, self.problem, self.key)


def _rebuild_yaml_error(file: str, problem: str, key: str | None) -> YamlFileError:
    return YamlFileError(file, problem, key=key)


class JsonFileError(K3Error):
    """A JSON file is unreadable, not strict JSON (a key twice, NaN, Infinity), or not the k3bundle
    kind and schema version expected (``k3bundle.io.strict_json``). ``problem`` is the message
    without the file; ``cause`` is "missing", "unreadable" (the file), "content" (the JSON) or
    "version" (kind or schema version); ``key`` and ``at`` say which key was given twice, and where."""

    def __init__(self, file: str, problem: str, *, cause: str = "content", key: str | None = None, at: tuple = ()):
        super().__init__(f"{file}: {problem}")
        self.file, self.problem, self.cause, self.key, self.at = str(file), problem, cause, key, tuple(at)

    def __reduce__(self):  # the keyword fields survive a trip between processes
        return _rebuild_json_error, (self.file, self.problem, self.cause, self.key, self.at)


def _rebuild_json_error(file: str, problem: str, cause: str, key: str | None, at: tuple) -> JsonFileError:
    return JsonFileError(file, problem, cause=cause, key=key, at=at)
