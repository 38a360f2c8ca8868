// Package agent owns the microVM guest agent: the small HTTP server that
// runs inside each microVM as `stasis microvm agent` (Serve), and the
// client the host uses to reach it through QEMU's forwarded TCP port
// (Client). It runs commands, moves files and tar streams, and reads and
// sets the guest's clock. It knows nothing of QEMU, images or snapshots:
// the provider in internal/providers/microvm owns those. The same code runs on the
// host in this package's tests.
//
// A VM may be snapshotted and restored at any moment. Connections open at
// that moment break; the agent keeps no per-connection state, so the
// restored agent serves new connections at once. A host should call
// Client.CloseIdle after a restore, so that no request goes out on a
// pooled connection that died with the snapshot.
//
// # Wire protocol (version 1)
//
// Every path starts with /v1. A request that fails before any output
// answers with the status errdefs.HTTPStatus gives its error and a JSON
// body {"kind": K, "error": "message"}, where K is one of not_found,
// invalid, timeout, unsupported or internal. The client turns the kind back
// into errdefs.ErrNotFound, errdefs.ErrInvalid, errdefs.ErrTimeout or
// errdefs.ErrUnsupported (a 404 or 405 without a kind, from an agent too old
// to know the path, is ErrUnsupported).
//
//	GET  /v1/health             200 {"ok":true}; cheap, for polling after boot and restore
//	GET  /v1/info               200 {"wall":W,"uptime":U,"boot_id":B,"pid":P}
//	POST /v1/clock              body {"unix":T}: set CLOCK_REALTIME to T; 204
//	POST /v1/exec               body: header line, then stdin; 200 and a frame stream
//	GET  /v1/file?path=P        200 and the file's bytes; trailer Stasis-Error
//	PUT  /v1/file?path=P&mode=M body: the bytes; 204
//	PUT  /v1/tar?dir=D          body: a tar stream, extracted into D; 204
//	GET  /v1/tar?dir=D          200 and a tar stream of D; trailer Stasis-Error
//
// W and T are Unix times in (fractional) seconds, U is seconds since boot
// from /proc/uptime, B is /proc/sys/kernel/random/boot_id and P is the
// agent's PID. M is the mode in octal, permission bits plus the setuid,
// setgid and sticky bits (07777). A relative P or D is taken relative to
// /work.
//
// # Exec
//
// The request body starts with one line of JSON ended by a newline (the
// header, at most 1 MiB):
//
//	{"argv":["sh","-c","…"],"env":{"K":"V"},"cwd":"/work","timeout_ms":0,"background":false,"log_path":"","user":""}
//
// Every field but argv may be left out. user is "" (the agent) or
// "control" (stasis's own user); anything else is invalid. It matters
// where the agent was started with the users split (Config.Users,
// `--agent-uid`, as every guest's init does): there a command runs as the
// agent's uid and gid with no supplementary groups and HOME the agent's
// home, unless user is "control", which runs it as the guest agent's own
// user (root, HOME=/root). A background command's log is opened as the
// command's user. Without the split every command runs as the agent's own
// user. The rest of the body is the
// command's standard input, streamed as it arrives (the server reads the
// body while it writes the response, so a command can answer input it has
// just been sent); the command sees end of file when the body ends. The
// environment is PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
// and HOME (as above), with env laid over it; nothing of the agent's own
// environment is passed on. argv[0] is looked up in that PATH. cwd defaults
// to /work. A command that cannot start still gives a frame stream: a
// message on stderr and exit code 125 (cwd unusable), 126 (found but not
// executable) or 127 (not found), as env(1) reports them.
//
// The response (200) begins as soon as the header is read, before the
// command starts; it is a stream of frames, each flushed as it is written:
//
//	kind (1 byte) | length (4 bytes, big-endian) | data (length bytes)
//
// Kinds are 'o' (stdout data), 'e' (stderr data) and 'x' (the end). Data is
// at most 1 MiB per frame (the agent writes at most 32 KiB). The end frame
// comes last, once the command has exited and its output pipes have
// closed; its data is JSON {"exit_code":N} where N is the exit status, or
// minus the signal number when a signal ended the command. When timeout_ms
// passed, the agent killed the command's whole process group (and every
// process below it), and the end frame is
// {"exit_code":-9,"kind":"timeout","error":"…"}. A stream that ends
// without an end frame means the exec broke. If the client goes away (its
// connection closes, or its body breaks off), the agent kills the command's
// process group the same way.
//
// With background set the command starts in its own session (setsid) with
// stdin from /dev/null and stdout and stderr appended to log_path (whose
// directory is made if missing; relative to cwd) or to /dev/null; the
// stream is a single end frame {"exit_code":0,"pid":P} sent at once. The
// agent waits for the command in the background, so no zombie stays. A
// background command that cannot start is an invalid error.
//
// # Files
//
// With the users split, PUT /v1/file and PUT /v1/tar write with the
// agent's file-system ids (fsuid, fsgid, no groups, so no file capability
// either): what they make is the agent's, and they cannot write where the
// agent could not, through a symlink it planted either. GET /v1/file and
// GET /v1/tar read as the guest agent's own user: what they read goes to
// the host, never to the agent.
//
// With Config.HostOnly (`--host-only`) a connection whose peer is the
// guest itself (a loopback address or an address of one of its
// interfaces) is closed unanswered: in a guest only QEMU's forwarding of
// the host's port reaches the agent, so a process in the guest cannot have
// the agent run a command as root.
//
// GET /v1/file answers not_found for a missing file or a directory (as the
// local provider does); an error while the bytes stream is reported in the
// Stasis-Error trailer, and the client returns it. PUT /v1/file writes
// atomically: a temporary file
// in the same directory, chmod to M, rename over P; missing parent
// directories are made (0755), and a P that is a symlink writes the file it
// points to. Writing over a directory is invalid.
//
// PUT /v1/tar makes D (and its parents) if missing and extracts into it
// with archive/tar through an os.Root, so that nothing outside D can change:
// an entry with an absolute name or a ".." element, or one that would be
// written through a symlink leading out of D, is refused as invalid (the
// entries before it stay extracted). Directories, regular files, symlinks
// (any target, created as given) and hard links (to an earlier entry) are
// extracted with their permission bits and modification times (a
// directory's are set once all entries are in; a symlink's own time is not
// kept); owners are not kept (entries belong to whoever extracts them:
// the agent's user with the users split); other entry kinds
// (devices, FIFOs) are skipped. An existing non-directory at an entry's
// name is replaced.
//
// GET /v1/tar answers not_found when D is missing or not a directory. Its
// entries are "./" and "./name…" (as `tar -C D -c .` makes them), in PAX
// format, with hard links kept as links. An error after the stream has
// begun is reported in the Stasis-Error trailer, and the client returns it.
package agent
