"""Install this workflow's global Snakemake profiles by name, so that `snakemake --profile slurm` works.

    python -m posttrain.workflow.profiles install slurm              # squeue status checks (no slurmdbd needed)
    python -m posttrain.workflow.profiles install slurm-accounting   # sacct status checks (clusters with slurmdbd)

Snakemake looks a profile name up in the working directory, then in its user configuration
directory (`$XDG_CONFIG_HOME/snakemake`, by default `~/.config/snakemake`), then in the site one
(`/etc/xdg/snakemake`). A profile holds what is specific to a cluster (executor, queue limits,
account, partition, status checks); the per-rule settings of this workflow live in its workflow
profile, `profiles/default`, which Snakemake loads by itself when it runs this Snakefile.
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_PROFILES = Path(__file__).resolve().parents[2] / "profiles"
CONFIG = "config.yaml"


@dataclass(frozen=True)
class Profile:
    """A global profile: a profile directory of this repository, with some top-level settings replaced."""

    source: str
    replace: tuple[tuple[str, str], ...] = ()
    why: str = ""


PROFILES = {
    "slurm": Profile("slurm", why="status checks with squeue (no slurmdbd needed)"),
    "slurm-accounting": Profile("slurm", (("slurm-status-command", "sacct"),),
                                "status checks with sacct (clusters that run slurmdbd)"),
}


def user_profile_dir() -> Path:
    """Where Snakemake looks for profiles by name, after the working directory (its own lookup)."""
    from snakemake.common import get_appdirs

    return Path(get_appdirs().user_config_dir)


def profile_text(name: str, profiles_dir: Path = REPO_PROFILES) -> str:
    """The config.yaml of profile `name`: its source's text with the profile's settings replaced."""
    profile = PROFILES[name]
    path = profiles_dir / profile.source / CONFIG
    text = path.read_text(encoding="utf-8")
    for key, value in profile.replace:
        pattern = re.compile(rf"^{re.escape(key)}:.*$", re.MULTILINE)
        text, count = pattern.subn(f"{key}: {value}   # profile {name}: {profile.why}", text)
        if count != 1:
            raise ValueError(f"{path}: needs exactly one top-level `{key}:` line for profile {name}, found {count}")
    return f"# Installed by `python -m posttrain.workflow.profiles install {name}` from {path}\n{text}"


def install(name: str, dest: Path | None = None, force: bool = False, profiles_dir: Path = REPO_PROFILES) -> Path:
    """Write profile `name` to `<dest>/<name>/config.yaml` (dest: Snakemake's user profile directory).

    An existing different profile is kept unless `force`: it may hold a user's account and partition.
    The directory is written beside its target and renamed into place, so no half-written profile is left.
    """
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; this workflow ships {', '.join(PROFILES)}")
    target = (dest or user_profile_dir()) / name
    text = profile_text(name, profiles_dir)
    if target.exists():
        existing = target / CONFIG
        if existing.is_file() and existing.read_text(encoding="utf-8") == text:
            return target
        if not force:
            raise FileExistsError(f"{target}: a profile named {name} exists and differs from this workflow's "
                                  f"(it may hold your account and partition); compare, or pass --force to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    (staging / CONFIG).write_text(text, encoding="utf-8")
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    return target


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("install", help="install a profile by name")
    add.add_argument("name", choices=sorted(PROFILES))
    add.add_argument("--dest", type=Path, help=f"profile directory (default: Snakemake's, here {user_profile_dir()})")
    add.add_argument("--force", action="store_true", help="replace an existing profile of that name")
    commands.add_parser("list", help="the profiles this workflow ships")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, profile in PROFILES.items():
            print(f"{name}: {profile.why}")
        return
    try:
        target = install(args.name, args.dest, args.force)
    except (FileExistsError, ValueError) as err:
        raise SystemExit(str(err)) from None
    print(f"profile {args.name} installed at {target}; run `snakemake --profile {args.name}` in this workflow's directory")


if __name__ == "__main__":
    main()
