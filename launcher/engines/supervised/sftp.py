"""`sync`'s copy: files copied to a host's workdir over SFTP, unchanged ones skipped, private files kept private."""

from __future__ import annotations

import os
import posixpath
import secrets
import stat as statmod

import paramiko

from launcher.engines.supervised.transport import SyncCounts


def sync_over_sftp(sftp: paramiko.SFTPClient, files: list[tuple[str, str]], workdir: str | None) -> SyncCounts:
    """Copy (local path, relative path) pairs below `workdir` over SFTP; skip unchanged files.

    A file counts as unchanged when the remote copy has the same size and modification time
    (the copy gets the local file's mtime and mode; an unchanged file whose mode differs gets the local
    mode). Each file is written into an owner-only temporary folder and renamed into place: an
    interrupted sync never leaves a half-written file, and no other user reads a private file while it
    is copied. Folders below the workdir get the mode of their local counterparts."""
    root = _sftp_dir(workdir)
    copied = unchanged = size = 0
    made: set[str] = set()
    for local, rel in files:
        remote = posixpath.join(root, rel) if root else rel
        st = os.stat(local)
        _sftp_makedirs(sftp, posixpath.dirname(remote), made, os.path.dirname(local), root)
        try:
            rst = sftp.stat(remote)
            if rst.st_size == st.st_size and int(rst.st_mtime or -1) == int(st.st_mtime):
                if statmod.S_IMODE(rst.st_mode or 0) != statmod.S_IMODE(st.st_mode):
                    sftp.chmod(remote, statmod.S_IMODE(st.st_mode))  # made private (or not) since
                unchanged += 1
                continue
        except FileNotFoundError:
            pass
        # copied into a fresh owner-only folder, then renamed into place: no other user can read a
        # private file while it is copied (a temporary file would be created 0644 before its chmod)
        box = posixpath.join(posixpath.dirname(remote), f".mgpu-sync-{secrets.token_hex(4)}")
        sftp.mkdir(box, mode=0o700)
        tmp = posixpath.join(box, posixpath.basename(remote))
        try:
            sftp.put(local, tmp, confirm=True)
            sftp.chmod(tmp, statmod.S_IMODE(st.st_mode))
            sftp.utime(tmp, (st.st_atime, st.st_mtime))
            try:
                sftp.posix_rename(tmp, remote)
            except OSError:
                sftp.remove(remote)
                sftp.rename(tmp, remote)
        finally:
            _sftp_clear(sftp, box)
        copied += 1
        size += st.st_size
    return {"copied": copied, "unchanged": unchanged, "bytes": size}


def _sftp_dir(workdir: str | None) -> str:
    """workdir as SFTP sees it: SFTP starts in the login folder, where ~ points."""
    if not workdir or workdir == "~":
        return ""
    return workdir[2:] if workdir.startswith("~/") else workdir


def _sftp_makedirs(sftp: paramiko.SFTPClient, path: str, made: set[str], local: str, root: str) -> None:
    """Make `path` and its missing parents. A synced folder (below `root`, the workdir) gets the mode of
    its local counterpart `local`, new or not; the workdir and its parents, if made, the host's default."""
    if not path or path in made or path in ("/", "."):
        return
    synced = not root or path.startswith(root.rstrip("/") + "/")
    mode = None
    if synced:
        try:  # the owner (we) always may enter and fill it
            mode = statmod.S_IMODE(os.stat(local).st_mode) | 0o700
        except OSError:
            mode = 0o700
    try:
        rst = sftp.stat(path)
        if not statmod.S_ISDIR(rst.st_mode or 0):
            raise OSError(f"{path} exists on the host and is not a folder")
        if mode is not None and statmod.S_IMODE(rst.st_mode or 0) != mode:
            sftp.chmod(path, mode)
        made.add(path)
        return
    except FileNotFoundError:
        pass
    _sftp_makedirs(sftp, posixpath.dirname(path), made, os.path.dirname(local), root)
    try:
        if mode is None:
            sftp.mkdir(path)
        else:
            sftp.mkdir(path, mode=0o700)  # no one else enters it before its mode is set
            sftp.chmod(path, mode)  # as the local folder, whatever the host's umask
    except OSError:
        if not statmod.S_ISDIR(sftp.stat(path).st_mode or 0):
            raise
    made.add(path)


def _sftp_clear(sftp: paramiko.SFTPClient, box: str) -> None:
    """Remove a sync's temporary folder (and a file left in it by an interrupted copy)."""
    try:
        for name in sftp.listdir(box):
            sftp.remove(posixpath.join(box, name))
        sftp.rmdir(box)
    except (OSError, EOFError, paramiko.SSHException):
        pass
