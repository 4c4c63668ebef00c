"""The calls `spaced` answers, and the error codes it uses (standard library only).

Both ends use the names below, never string literals: spaced's handler table keys on them
(space.guest.daemon), and the node's client of the daemon calls through them (space.node.agent.guest).

A call is a CALL frame {"method": M, "params": {...}} on a fresh stream id chosen by the host. The daemon
answers on the same stream with any number of EVENT / DATA / EOF frames and exactly one terminal frame:
RESULT (a JSON object) or ERROR ({"code": one of GUEST_ERROR_CODES, "message": str}). The host may send
DATA/EOF frames (channel BODY) on the stream after the CALL (a request body) and CANCEL to stop it.

Connection: the daemon sends HELLO on stream 0 as soon as it starts ({"protocol", "min_protocol",
"ready": true, "boot_id", "pid"}). A host that (re)connects sends HELLO on stream 0 and gets one back.

sys.ping     {}                                   -> {"time": float}
sys.info     {}                                   -> {"boot_id", "pid", "uptime", "last_activity",
                                                      "idle_seconds", "running_processes", "protocol"}
sys.sync     {}                                   -> {}   flush file data (before a disk snapshot)
sys.reseed   {"entropy": hex str}                 -> {}   after a restore: new randomness, new tokens
sys.configure {"env": {str: str}}                 -> {"env": [names]}  env inherited by later processes
process.start {"argv": [str] | "cmd": str, "env": {str: str}, "cwd": str, "user": str|int,
               "timeout": float, "pty": {"rows", "cols"}, "stdin": bool, "background": bool,
               "tag": str}
    foreground: EVENT {"type": "started", "process_id", "pid"}; DATA STDOUT/STDERR as it comes
                (a PTY's output is STDOUT); host DATA/EOF BODY is the stdin (when "stdin": true);
                RESULT {"process_id", "exit_code": int|None, "signal": int|None, "timed_out": bool}.
                CANCEL detaches without killing: the process stays attachable by id.
    background: RESULT {"process_id", "pid"} at once; output kept in a bounded buffer.
process.attach {"process_id", "offset": int = 0, "follow": bool = true}
    EVENT {"type": "attached", "offset": first offset delivered, "truncated": bool}; DATA frames of the
    combined output log (stdout+stderr, offsets count bytes of both in arrival order); then RESULT as for
    a foreground start once the process exited and all output was sent (follow=false: RESULT
    {"offset": next offset, "running": bool} after what is buffered).
process.input  {"process_id", "eof": bool}  + host DATA BODY frames + EOF BODY -> {"written": int}
process.signal {"process_id", "signal": int | "SIGTERM"-style name}              -> {}
process.resize {"process_id", "rows", "cols"}                                    -> {}
process.list   {} -> {"processes": [{"process_id", "pid", "argv", "tag", "running", "exit_code",
                                     "signal", "started_at", "ended_at", "pty", "output_bytes"}]}
files.read   {"path", "offset": int = 0, "length": int|None} -> DATA BODY chunks, RESULT {"size"}
files.write  {"path", "mode": int|None, "append": bool, "parents": bool = true}
             + host DATA BODY + EOF BODY -> {"size"}   (atomic: temp file + rename unless appending)
files.list   {"path"}                    -> {"entries": [stat]}
files.stat   {"path"}                    -> stat = {"name", "path", "type": file|dir|symlink|other,
                                                     "size", "mode", "mtime", "uid", "gid", "target"}
files.mkdir  {"path", "parents": bool = true, "mode": int = 0o755} -> {}
files.remove {"path", "recursive": bool = false}                   -> {}
files.rename {"src", "dst"}                                        -> {}
files.chmod  {"path", "mode": int}                                 -> {}
files.watch  {"path", "recursive": bool = false}
             -> EVENT {"type": "changes", "changes": [{"path", "kind": created|modified|deleted}]}
                until CANCEL, then RESULT {}

Details and extensions fixed by the daemon (spaced, space.guest); hosts ignore fields they do not know:
- HELLO answering a host's HELLO also carries "negotiated" (the chosen version). ERROR frames sent on
  stream 0 about a frame of another stream carry "stream". ERRORs from an OS error carry "errno".
- Request bodies are accepted only by process.start (with "stdin": true), process.input and files.write;
  BODY frames sent to any other call are dropped.
- process.start / process.attach (follow) RESULT also carries "offset" (the next output offset).
  CANCEL of a foreground start or a following attach ends the call with ERROR {"code": "cancelled",
  "process_id", "offset"}; the process keeps running. "pty": true means {"rows": 24, "cols": 80}.
  A foreground PTY's EOF BODY types ^D rather than closing the terminal. The RESULT comes once the
  process exited and its output reached EOF, or 0.5 s after the exit when descendants keep it open.
- process.signal {"process_id", "signal", "group": bool = true}: by default the whole process group
  (each process is a session leader) gets the signal; group=false signals the process alone.
  The name may omit "SIG" and is case-insensitive ("term", "KILL").
- process.list entries also carry "timed_out", "background" and "cwd" (the directory it was started in);
  with params {"env": true} also "env" (the variables its start asked for, not the inherited ones).
- files.read RESULT is {"size": the file's size, "read": bytes delivered}.
- files.list of a directory too large for one frame sends EVENT {"type": "entries", "entries": [...]}
  batches first; the RESULT holds the last batch (the host concatenates, in order; sorted by name).
- files.watch sends EVENT {"type": "watching", "backend": "inotify"|"poll"} once the watch is in place,
  before any "changes" event.
- files.watch changes may carry "cause", refining their kind: "renamed" on the "deleted" of a path renamed
  away, "attrib" on a "modified" of metadata only (mode, owner, times).
- stat entries (files.stat, files.list) also carry "permissions" ("-rw-r--r--"), "modified" (ISO 8601,
  UTC), "owner" and "group" (names from the sandbox's passwd/group, None for an id without one),
  "symlink_target" (= "target": a symlink's text, never resolved) and, for a name that is not UTF-8,
  "path_b64" (the exact bytes; "name"/"path" then show U+FFFD). files.stat {"follow": bool = false}
  describes a symlink's destination ("is_symlink": true, "symlink_resolved") or, when it cannot be
  followed, the link with "broken": true; {"xattrs": bool = false} adds "xattrs": {name: value_b64}.
- files.list {"depth": 1..16 = 1, "limit": 1..50000 = 50000, "xattrs": bool = false}: entries below the
  path up to depth levels, pre-order with each directory's children by name, never through a symlink;
  the RESULT also carries "truncated" (the limit cut the walk).
- files.mkdir RESULT is {"created": bool (false: it was there, with parents), "entry": stat}.
- files.rename {"parents": bool = false} makes the destination's parents; RESULT {"entry": stat of dst}.
- files.xattr_list {"path"} -> {"xattrs": {name: value_b64}}; files.xattr_get {"path", "name"} ->
  {"name", "value_b64"}; files.xattr_set {"path", "name", "value_b64"} -> {}; files.xattr_remove
  {"path", "name"} -> {}. Names are "user.*" only (<= 255 bytes), values <= 65536 bytes; a filesystem
  without user attributes answers "not_supported", a missing attribute "not_found".
- process.resize of a process without a terminal answers "not_a_terminal" (older daemons:
  "invalid_argument").
- files.write through a symlink writes the symlink's target; an overwrite keeps the target's mode (and
  owner, when root) unless "mode" is given; files.remove refuses "/" (permission_denied).
"""

from __future__ import annotations

# --- method names (the "method" of a CALL frame) ----------------------------------------------------------

SYS_PING = "sys.ping"
SYS_INFO = "sys.info"
SYS_SYNC = "sys.sync"
SYS_RESEED = "sys.reseed"
SYS_CONFIGURE = "sys.configure"
PROCESS_START = "process.start"
PROCESS_ATTACH = "process.attach"
PROCESS_INPUT = "process.input"
PROCESS_SIGNAL = "process.signal"
PROCESS_RESIZE = "process.resize"
PROCESS_LIST = "process.list"
FILES_READ = "files.read"
FILES_WRITE = "files.write"
FILES_LIST = "files.list"
FILES_STAT = "files.stat"
FILES_MKDIR = "files.mkdir"
FILES_REMOVE = "files.remove"
FILES_RENAME = "files.rename"
FILES_CHMOD = "files.chmod"
FILES_WATCH = "files.watch"
FILES_XATTR_LIST = "files.xattr_list"
FILES_XATTR_GET = "files.xattr_get"
FILES_XATTR_SET = "files.xattr_set"
FILES_XATTR_REMOVE = "files.xattr_remove"

#: Every method spaced answers; any other name is answered with ERROR "unknown_method".
METHODS = frozenset(
    {
        SYS_PING,
        SYS_INFO,
        SYS_SYNC,
        SYS_RESEED,
        SYS_CONFIGURE,
        PROCESS_START,
        PROCESS_ATTACH,
        PROCESS_INPUT,
        PROCESS_SIGNAL,
        PROCESS_RESIZE,
        PROCESS_LIST,
        FILES_READ,
        FILES_WRITE,
        FILES_LIST,
        FILES_STAT,
        FILES_MKDIR,
        FILES_REMOVE,
        FILES_RENAME,
        FILES_CHMOD,
        FILES_WATCH,
        FILES_XATTR_LIST,
        FILES_XATTR_GET,
        FILES_XATTR_SET,
        FILES_XATTR_REMOVE,
    }
)

#: The methods that take a request body (host DATA/EOF BODY frames after the CALL); spaced drops the BODY
#: frames sent to any other call.
BODY_METHODS = frozenset({PROCESS_START, PROCESS_INPUT, FILES_WRITE})

#: Calls whose method starts with this are the node's own health and activity polls: they do not count as
#: activity of the sandbox (sys.info's "last_activity" / "idle_seconds").
SYSTEM_PREFIX = "sys."

# --- EVENT frames: the value of their "type" field --------------------------------------------------------

EVENT_STARTED = "started"  # process.start (foreground): {"process_id", "pid"}
EVENT_ATTACHED = "attached"  # process.attach: {"offset", "truncated"}
EVENT_ENTRIES = "entries"  # files.list: {"entries": [stat]}, a batch before the RESULT
EVENT_WATCHING = "watching"  # files.watch: {"backend"}, once the watch is in place
EVENT_CHANGES = "changes"  # files.watch: {"changes": [{"path", "kind"}]}

GUEST_ERROR_CODES = frozenset(
    {
        "not_found",
        "already_exists",
        "not_a_directory",
        "is_a_directory",
        "not_empty",
        "permission_denied",
        "invalid_argument",
        "no_such_process",
        "not_a_terminal",
        "not_supported",
        "unknown_method",
        "no_space",
        "cancelled",
        "internal",
        # protocol-level codes (see space.protocol.errors)
        "protocol_error",
        "corrupt_frame",
        "truncated_frame",
        "frame_too_large",
        "unknown_frame_type",
        "malformed_payload",
        "version_mismatch",
    }
)
