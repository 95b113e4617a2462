"""The one place llmstack touches DeepSpeed and transformers beyond their documented API.

`llmstack.compat.deepspeed` and `llmstack.compat.transformers` (and, for one setting,
`llmstack.compat.torch_distributed`) wrap each private attribute,
internal class and undocumented behaviour llmstack relies on in one small function, and check on
import (when a trainer or command first needs the library, never on `import llmstack`) that the
installed version is in the supported range and has every attribute those functions use. What is
missing stops the run with one `IncompatibleLibraryError` naming the supported range, before any
expensive start-up. tests/test_compat.py has a test per internal, so a version bump that removes
or renames one fails CI, not a training run.
"""

from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from llmstack.errors import UserError


class IncompatibleLibraryError(UserError):
    """The installed DeepSpeed or transformers is outside the supported range, or lacks an
    attribute or behaviour llmstack relies on."""


@dataclass(frozen=True)
class SupportedRange:
    """The versions of one library llmstack supports, e.g. SupportedRange("deepspeed", ">=0.19.8,<0.20")."""

    package: str
    specifier: str

    def contains(self, version: str) -> bool:
        try:
            return SpecifierSet(self.specifier).contains(Version(version), prereleases=True)
        except InvalidVersion:
            return False

    def error(self, installed: str, missing: list[str] | tuple[str, ...] = ()) -> IncompatibleLibraryError | None:
        """The error to raise for version `installed` lacking `missing` (descriptions of attributes
        or behaviours), or None when it is in range and nothing is missing."""
        hint = f"pip install '{self.package}{self.specifier}'"
        if not self.contains(installed):
            return IncompatibleLibraryError(
                f"{self.package} {installed} is installed, but llmstack supports {self.package}{self.specifier}; "
                f"install a supported version: {hint}"
            )
        if missing:
            return IncompatibleLibraryError(
                f"{self.package} {installed} lacks what llmstack relies on ({'; '.join(missing)}); llmstack "
                f"supports {self.package}{self.specifier} as released: reinstall a supported version: {hint}"
            )
        return None

    def check(self, installed: str, missing: list[str] | tuple[str, ...] = ()) -> None:
        """Raise IncompatibleLibraryError unless `installed` is in range and nothing is `missing`."""
        error = self.error(installed, missing)
        if error is not None:
            raise error


def missing_attributes(obj: object, names: tuple[str, ...], label: str) -> list[str]:
    """Descriptions of the `names` that `obj` lacks, e.g. ["DeepSpeedEngine.skipped_steps"]."""
    return [f"{label}.{name}" for name in names if not hasattr(obj, name)]
