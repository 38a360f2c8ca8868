// Package checkpoint owns the host side of the checkpoint protocol. Session
// binds one sandbox, one session directory in it and one harness launch
// under a supervisor, and drives pause and continue through the provider's
// exec, so it works on every provider.
package checkpoint

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path"
	"strconv"
	"strings"
	"sync"
	"time"

	"stasis/errdefs"
	"stasis/internal/control/relay"
	"stasis/internal/guestclock"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/proc"
	"stasis/internal/sandboxbin"
	"stasis/sandbox"
)

// SessionRoot is where episodes' session directories are inside a sandbox
// (stasis's own: the supervisor's socket, acknowledgements, the relay's
// credentials; the harness's own directory below it).
const SessionRoot = "/tmp/stasis"

// SessionDir is an episode's session directory inside its sandbox.
func SessionDir(episode string) string { return path.Join(SessionRoot, episode) }

// BinaryPath is where a session places the stasis binary inside a sandbox.
const BinaryPath = "/tmp/.stasis/bin/stasis"

// SessionOptions configure NewSession.
type SessionOptions struct {
	Provider sandbox.Provider
	// Sandbox is a sandbox to borrow; empty to create one from Spec, which
	// the session then owns and deletes on Close. Adopt makes the session
	// own a given Sandbox too (a fork made for it).
	Sandbox string
	Adopt   bool
	// Running: the supervisor already runs in Sandbox (a session found
	// again after a restart, or in a fork that kept processes); Start is
	// then refused and Close stops it.
	Running bool
	Spec    sandbox.Spec
	// Episode names the session; it also names the session directory.
	Episode string
	// Dir is the session directory inside the sandbox (default
	// /tmp/stasis/EPISODE).
	Dir string
	// PauseMode is fixed for the session's life: stop (default) or hold.
	PauseMode supervisor.Mode
	// Harness is the command the supervisor launches; ResumeCmd the shell
	// command that relaunches it after an unconfirmed pause.
	Harness            []string
	ResumeCmd          string
	Deadline           time.Duration
	Grace              time.Duration
	StopConfirmTimeout time.Duration
	// Binary is the host's stasis binary to place in the sandbox (default:
	// this executable); BinaryEnv is environment it needs (tests).
	Binary    string
	BinaryEnv map[string]string
	// BinaryInSandbox, when set, is where the stasis binary already is in
	// the sandbox (a provider that binds it in read-only, as the local one
	// can): the session then copies nothing, and snapshots do not carry
	// the binary.
	BinaryInSandbox string
	// Env is added to the supervisor's environment, which the harness
	// inherits.
	Env map[string]string
	// Relay, when set, makes the supervisor host the model relay.
	Relay *RelayOptions
	// HarnessSession is the harness's own session id (for relaunch), if any.
	HarnessSession string
	Attempt        int
}

// RelayOptions are the supervisor's relay flags; paths are inside the
// sandbox.
type RelayOptions struct {
	// Listen is where the harness reaches the relay (host:port or
	// unix:PATH).
	Listen string
	// Upstream is the gateway as the sandbox reaches it (http://,
	// https:// or unix://PATH).
	Upstream string
	// TokenFile holds the episode's gateway credentials (written by the
	// host before Start and before each continue that raises the attempt).
	TokenFile string
}

// Session is one harness launch under a supervisor in a sandbox.
type Session struct {
	o     SessionOptions
	p     sandbox.Provider
	id    string // sandbox id
	owned bool

	mu      sync.Mutex
	started bool
	closed  bool
	lastAck *supervisor.Ack // the last pause acknowledgement
	inForce bool            // lastAck's pause is in force (not continued)
}

// ErrHoldNeedsProcesses refuses hold mode on a file-only provider.
var ErrHoldNeedsProcesses = errors.New("hold pause needs a provider whose snapshots keep processes")

// NewSession checks the options, creates or borrows the sandbox, and places
// the stasis binary in it. Start launches the harness.
func NewSession(ctx context.Context, o SessionOptions) (*Session, error) {
	if o.Provider == nil {
		return nil, errors.New("session: no provider")
	}
	if o.PauseMode == "" {
		o.PauseMode = supervisor.ModeStop
	}
	if _, err := supervisor.ParseMode(string(o.PauseMode)); err != nil {
		return nil, fmt.Errorf("session: %w", err)
	}
	if o.PauseMode.Holds() && !o.Provider.Capabilities().KeepsProcesses {
		return nil, fmt.Errorf("session %s: %w: the %s provider's snapshots are file-only, so a harness left running would change files while they are copied; use pause mode stop", o.Episode, ErrHoldNeedsProcesses, o.Provider.Name())
	}
	if o.PauseMode == supervisor.ModeHoldFreeze && !o.Provider.Capabilities().Freeze {
		return nil, fmt.Errorf("session %s: pause mode hold+freeze: %s", o.Episode, sandbox.NoFreezeReason(o.Provider.Name()))
	}
	if len(o.Harness) == 0 {
		return nil, fmt.Errorf("session %s: no harness command", o.Episode)
	}
	if o.Episode == "" || strings.ContainsAny(o.Episode, "/ \x00") || o.Episode == "." || o.Episode == ".." {
		return nil, fmt.Errorf("session: episode name %q must be non-empty, without slashes or spaces", o.Episode)
	}
	if o.Dir == "" {
		o.Dir = SessionDir(o.Episode)
	}
	if o.Binary == "" {
		exe, err := sandboxbin.Path()
		if err != nil {
			return nil, err
		}
		o.Binary = exe
	}
	s := &Session{o: o, p: o.Provider, id: o.Sandbox, started: o.Running}
	if s.id == "" {
		if o.Spec.Labels == nil {
			o.Spec.Labels = map[string]string{}
		}
		o.Spec.Labels["stasis.episode"] = o.Episode
		info, err := o.Provider.Create(ctx, o.Spec)
		if err != nil {
			return nil, fmt.Errorf("session %s: create a sandbox: %w", o.Episode, err)
		}
		s.id, s.owned = info.ID, true
	} else if _, err := o.Provider.Get(ctx, s.id); err != nil {
		return nil, fmt.Errorf("session %s: borrow sandbox %s: %w", o.Episode, s.id, err)
	} else {
		s.owned = o.Adopt
	}
	if err := s.placeBinary(ctx); err != nil {
		cctx := context.WithoutCancel(ctx)
		_ = Retry(func() error { return s.Close(cctx) })
		return nil, err
	}
	return s, nil
}

// cleanupTries bounds the attempts at a cleanup: one transient failure of
// the provider must not leave a sandbox behind.
const cleanupTries = 5

// Backoff is how a cleanup step is retried: at most Tries runs, waiting
// Base, then twice as long each time, between them. Sleep waits (a test
// gives one that records the waits and moves its own clock).
type Backoff struct {
	Tries int
	Base  time.Duration
	Sleep func(time.Duration)
}

// DefaultBackoff is Retry's: cleanupTries runs, 10 ms apart at first.
var DefaultBackoff = Backoff{Tries: cleanupTries, Base: 10 * time.Millisecond, Sleep: time.Sleep}

// Retry runs fn until it succeeds, at most b.Tries times, and returns its
// last error.
func (b Backoff) Retry(fn func() error) error {
	var err error
	for i := range max(b.Tries, 1) {
		if err = fn(); err == nil {
			return nil
		}
		if i < b.Tries-1 {
			b.Sleep(b.Base << i)
		}
	}
	return err
}

// Retry runs a cleanup step (deleting a sandbox or a snapshot, continuing
// a paused episode) until it succeeds, at most a few times with a short
// backoff (DefaultBackoff), and returns its last error.
func Retry(fn func() error) error { return DefaultBackoff.Retry(fn) }

// SetHarnessSession records the harness's own session id (found once the
// harness has saved one), for CheckpointState.
func (s *Session) SetHarnessSession(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.o.HarnessSession = id
}

// binPath is the stasis binary inside the sandbox.
func (s *Session) binPath() string {
	if s.o.BinaryInSandbox != "" {
		return s.o.BinaryInSandbox
	}
	return BinaryPath
}

// SandboxID is the session's sandbox.
func (s *Session) SandboxID() string { return s.id }

// Dir is the session directory inside the sandbox.
func (s *Session) Dir() string { return s.o.Dir }

// placeBinary copies the stasis binary into the sandbox unless the same
// version is already there.
func (s *Session) placeBinary(ctx context.Context) error {
	if s.o.BinaryInSandbox != "" {
		return nil
	}
	want, err := os.ReadFile(s.o.Binary)
	if err != nil {
		return fmt.Errorf("session %s: read the stasis binary %s: %w", s.o.Episode, s.o.Binary, err)
	}
	if have, err := s.p.ReadFile(ctx, s.id, BinaryPath); err == nil && bytes.Equal(have, want) {
		return nil
	}
	if err := s.writeControl(ctx, BinaryPath, want, 0o755); err != nil {
		return fmt.Errorf("session %s: place the stasis binary in %s: %w", s.o.Episode, s.id, err)
	}
	return nil
}

// users says whether the sandbox runs the agent and stasis as separate
// users (sandbox.Capabilities.Users): then everything of the session's own
// (the directory, the credentials, the supervisor, ctl) is stasis's user's,
// and only the harness's directory is the agent's.
func (s *Session) users() bool { return s.p.Capabilities().Users }

// AgentHome is HOME in the agent's commands in the sandbox ("" when the
// provider sets none).
func (s *Session) AgentHome(ctx context.Context) (string, error) { return s.agentHome(ctx) }

// agentHome is HOME in the agent's commands in the sandbox ("" when the
// provider sets none).
func (s *Session) agentHome(ctx context.Context) (string, error) {
	var out, errb bytes.Buffer
	res, err := s.p.Exec(ctx, s.id, sandbox.ExecRequest{
		Argv: []string{"/bin/sh", "-c", `printf %s "$HOME"`}, Stdout: &out, Stderr: &errb, Timeout: time.Minute,
	})
	if err != nil {
		return "", fmt.Errorf("the agent's home: %w", err)
	}
	if res.ExitCode != 0 {
		return "", fmt.Errorf("the agent's home: exit %d: %s", res.ExitCode, strings.TrimSpace(errb.String()))
	}
	h := out.String()
	if !path.IsAbs(h) || strings.ContainsAny(h, "\n\x00") {
		return "", nil
	}
	return h, nil
}

// control is the user stasis's own commands run as in the sandbox.
func (s *Session) control() sandbox.User {
	if s.users() {
		return sandbox.UserControl
	}
	return sandbox.UserAgent
}

// writeControl writes a file of stasis's own in the sandbox: as its user,
// atomically, with mode, so that the agent can neither read a secret
// nor change what stasis runs. Without users it is the provider's
// WriteFile.
func (s *Session) writeControl(ctx context.Context, name string, data []byte, mode os.FileMode) error {
	if !s.users() {
		return s.p.WriteFile(ctx, s.id, name, data, mode)
	}
	var errb bytes.Buffer
	// Every directory on the way must be stasis's own: one the agent
	// owned it could swap.
	script := `set -e; umask "$3"; f="$1"; d="${f%/*}"; mkdir -p -- "$d"
x="$d"; while [ -n "$x" ] && [ "$x" != / ]; do
  if [ -L "$x" ] || [ "$(stat -c %u -- "$x")" != 0 ]; then echo "$x is not stasis's own" >&2; exit 3; fi
  x="${x%/*}"
done
t="$f.stasis-tmp"; rm -f -- "$t"; cat > "$t"; chmod "$2" -- "$t"; mv -f -- "$t" "$f"`
	umask := "022"
	if mode.Perm()&0o077 == 0 {
		umask = "077"
	}
	res, err := s.p.Exec(ctx, s.id, sandbox.ExecRequest{
		Argv: []string{"/bin/sh", "-c", script, "stasis-write", name, fmt.Sprintf("%o", mode.Perm()), umask},
		User: sandbox.UserControl, Stdin: bytes.NewReader(data), Stderr: &errb, Timeout: 2 * time.Minute,
	})
	if err != nil {
		return err
	}
	if res.ExitCode != 0 {
		return fmt.Errorf("write %s as stasis's user: exit %d: %s", name, res.ExitCode, strings.TrimSpace(errb.String()))
	}
	return nil
}

// WriteSecret writes a file into the session directory that only stasis's
// user in the sandbox may read (mode 0600): the relay's credentials.
func (s *Session) WriteSecret(ctx context.Context, name string, data []byte) error {
	if strings.Contains(name, "/") || name == "" || name == "." || name == ".." {
		return fmt.Errorf("session %s: secret file name %q: give a plain name", s.o.Episode, name)
	}
	return s.writeControl(ctx, path.Join(s.o.Dir, name), data, 0o600)
}

// PrepareDirs makes the session directory, stasis's own (mode 0711: the
// harness may pass through it to its own directory but not list it or
// change what is in it), and each of agentDirs below it as the agent's
// (mode 0700). It refuses a directory already there that is not
// stasis's own or is a symlink. Without users, it makes them plainly.
func (s *Session) PrepareDirs(ctx context.Context, agentDirs ...string) error {
	for _, d := range agentDirs {
		if d == "" || strings.Contains(d, "/") || d == "." || d == ".." {
			return fmt.Errorf("session %s: directory name %q: give a plain name", s.o.Episode, d)
		}
	}
	script := `set -e; d="$1"; shift
for x in "${d%/*}" "$d"; do
  if [ -L "$x" ] || { [ -e "$x" ] && [ "$(stat -c %u -- "$x")" != 0 ]; }; then echo "$x is not stasis's own" >&2; exit 3; fi
done
mkdir -p -- "${d%/*}" "$d"; chmod 0755 -- "${d%/*}"; chmod 0711 -- "$d"
for a in "$@"; do
  if [ -L "$d/$a" ]; then rm -f -- "$d/$a"; fi
  mkdir -p -- "$d/$a"; chown -R ` + fmt.Sprintf("%d:%d", sandbox.AgentUID, sandbox.AgentUID) + ` -- "$d/$a"; chmod 0700 -- "$d/$a"
done`
	if !s.users() {
		script = `set -e; d="$1"; shift; mkdir -p -- "$d"; for a in "$@"; do mkdir -p -- "$d/$a"; done`
	}
	var errb bytes.Buffer
	res, err := s.p.Exec(ctx, s.id, sandbox.ExecRequest{
		Argv: append([]string{"/bin/sh", "-c", script, "stasis-dirs", s.o.Dir}, agentDirs...),
		User: s.control(), Stderr: &errb, Timeout: 2 * time.Minute,
	})
	if err != nil {
		return fmt.Errorf("session %s: make %s: %w", s.o.Episode, s.o.Dir, err)
	}
	if res.ExitCode != 0 {
		return fmt.Errorf("session %s: make %s: exit %d: %s", s.o.Episode, s.o.Dir, res.ExitCode, strings.TrimSpace(errb.String()))
	}
	return nil
}

// stasis runs the stasis binary inside the sandbox, as stasis's user.
func (s *Session) stasis(ctx context.Context, args ...string) (stdout []byte, code int, stderr string, err error) {
	var out, errb bytes.Buffer
	res, err := s.p.Exec(ctx, s.id, sandbox.ExecRequest{
		Argv: append([]string{s.binPath()}, args...), Env: s.o.BinaryEnv, User: s.control(), Stdout: &out, Stderr: &errb, Timeout: 2 * time.Minute,
	})
	if err != nil {
		return nil, 0, "", err
	}
	return out.Bytes(), res.ExitCode, strings.TrimSpace(errb.String()), nil
}

// Start launches the supervisor, which launches the harness, and waits
// until its control socket answers.
func (s *Session) Start(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("session %s: closed", s.o.Episode)
	}
	if s.started {
		return fmt.Errorf("session %s: already started", s.o.Episode)
	}
	args := []string{"supervise", "--dir", s.o.Dir, "--mode", string(s.o.PauseMode), "--log-format", "json"}
	if s.o.Deadline > 0 {
		args = append(args, "--deadline", s.o.Deadline.String())
	}
	if s.o.Grace > 0 {
		args = append(args, "--grace", s.o.Grace.String())
	}
	if s.o.StopConfirmTimeout > 0 {
		args = append(args, "--stop-confirm-timeout", s.o.StopConfirmTimeout.String())
	}
	if s.o.ResumeCmd != "" {
		args = append(args, "--resume-cmd", s.o.ResumeCmd)
	}
	if r := s.o.Relay; r != nil {
		args = append(args, "--relay-listen", r.Listen, "--relay-upstream", r.Upstream, "--relay-token-file", r.TokenFile)
	}
	if s.users() {
		// The harness runs as the agent, jailed; the supervisor and its
		// relay stay stasis's user's.
		id := strconv.Itoa(sandbox.AgentUID)
		args = append(args, "--harness-uid", id, "--harness-gid", id)
		// The agent's home as the provider gives it to the agent's
		// commands: an image's /etc/passwd may not know the uid, and
		// OpenCode (Bun) will not start without a HOME.
		home, err := s.agentHome(ctx)
		if err != nil {
			return fmt.Errorf("session %s: %w", s.o.Episode, err)
		}
		if home != "" {
			args = append(args, "--harness-home", home)
		}
	}
	args = append(append(args, "--"), s.o.Harness...)
	// The provider makes the log's directory, the session directory.
	env := map[string]string{}
	for k, v := range s.o.Env {
		env[k] = v
	}
	for k, v := range s.o.BinaryEnv {
		env[k] = v
	}
	// A fork may hold the receipt of the launch that ended in it, which
	// answers a status until the new supervisor has moved it aside: that
	// launch's identity is not taken for the new one's.
	var before *proc.Identity
	if s.o.Adopt {
		if b, err := s.p.ReadFile(ctx, s.id, path.Join(s.o.Dir, supervisor.ReceiptFile)); err == nil {
			var rc supervisor.Receipt
			if json.Unmarshal(b, &rc) == nil {
				before = &rc.Identity
			}
		}
	}
	if _, err := s.p.Exec(ctx, s.id, sandbox.ExecRequest{
		Argv: append([]string{s.binPath()}, args...), Env: env, Background: true, LogPath: path.Join(s.o.Dir, "supervisor.log"), User: s.control(),
	}); err != nil {
		return fmt.Errorf("session %s: start the supervisor: %w", s.o.Episode, err)
	}
	s.started = true
	// One exec that waits for the supervisor to answer (more only while
	// the old receipt answers instead).
	deadline := time.Now().Add(30 * time.Second)
	var err error
	for {
		var out []byte
		out, err = s.ctl(ctx, "--wait", "30s", "status")
		if err == nil {
			var st supervisor.Status
			if json.Unmarshal(out, &st) != nil || st.State == "" {
				err = fmt.Errorf("bad status %q", out)
			} else if before == nil || st.Identity != *before {
				return nil
			} else {
				err = fmt.Errorf("only the receipt of the launch that ended in the fork (pid %d) answers", before.PID)
			}
		}
		if !time.Now().Before(deadline) || ctx.Err() != nil {
			break
		}
		if !sleepCtx(ctx, 20*time.Millisecond) { // poll interval, bounded by the deadline above
			break
		}
	}
	log, _ := s.p.ReadFile(ctx, s.id, path.Join(s.o.Dir, "supervisor.log"))
	return fmt.Errorf("session %s: the supervisor did not answer within 30s (%v); its log: %s", s.o.Episode, err, strings.TrimSpace(string(log)))
}

// sleepCtx waits d or until ctx ends, and says whether d passed.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// FindStarted reports whether a supervisor answers in the session
// directory within wait and is not the launch old: the relaunch this
// session was to start, started by an earlier process that died before
// it knew (a restore interrupted in its last step). When one answers, the
// session counts as started (Start is refused, Close stops it). A
// directory where nothing answers, or only old's receipt, gives false.
func (s *Session) FindStarted(ctx context.Context, wait time.Duration, old proc.Identity) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started {
		return true, nil
	}
	out, err := s.ctl(ctx, "--wait", wait.String(), "status")
	var ce *ctlError
	switch {
	case errors.As(err, &ce) && ce.Code == supervisor.CodeUnreachable:
		return false, nil
	case err != nil:
		return false, err
	}
	var st supervisor.Status
	if err := json.Unmarshal(out, &st); err != nil {
		return false, fmt.Errorf("session %s: bad status %q: %w", s.o.Episode, out, err)
	}
	if st.Identity == old {
		return false, nil
	}
	s.started = true
	return true, nil
}

// logTail is the last n bytes of the supervisor's log (the harness's
// output is in it), or a note saying why there is none.
func (s *Session) logTail(ctx context.Context, n int) string {
	b, err := s.p.ReadFile(ctx, s.id, path.Join(s.o.Dir, "supervisor.log"))
	if err != nil {
		return fmt.Sprintf("(unread: %v)", err)
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return strings.TrimSpace(string(b))
}

// ctlError is a refusal or failure reported by `stasis ctl`.
type ctlError struct {
	Op     string
	Code   string
	Msg    string
	Status *supervisor.Status
}

func (e *ctlError) Error() string { return e.Op + ": " + e.Msg }

// kind is the error's kind in package errdefs's vocabulary: a refusal is a
// conflict, a malformed request invalid.
func (e *ctlError) kind() error {
	switch e.Code {
	case supervisor.CodeRefused:
		return errdefs.ErrConflict
	case supervisor.CodeInvalid:
		return errdefs.ErrInvalid
	}
	return nil
}

// Is makes a refusal by a supervisor that has exited match ErrExited, and
// the error match its kind.
func (e *ctlError) Is(target error) bool {
	if k := e.kind(); k != nil && target == k {
		return true
	}
	return target == ErrExited && e.Status != nil && e.Status.State == supervisor.StateExited
}

// ErrExited matches a request refused because the supervisor has exited:
// its harness has ended, and a continue can no longer take effect.
var ErrExited = errors.New("the supervisor has exited")

// IsRefused reports whether err is the supervisor refusing a request
// (stale or repeated sequence numbers, a harness that has ended).
func IsRefused(err error) bool {
	var ce *ctlError
	return errors.As(err, &ce) && ce.Code == supervisor.CodeRefused
}

// IsUnreachable reports whether err is a control command's that found no
// supervisor: nothing answers on its control socket and it left no
// receipt (it was killed, or never started).
func IsUnreachable(err error) bool {
	var ce *ctlError
	return errors.As(err, &ce) && ce.Code == supervisor.CodeUnreachable
}

func (s *Session) ctl(ctx context.Context, args ...string) ([]byte, error) {
	out, code, errOut, err := s.stasis(ctx, append([]string{"ctl", "--dir", s.o.Dir}, args...)...)
	if err != nil {
		return nil, fmt.Errorf("session %s: ctl %s: %w", s.o.Episode, strings.Join(args, " "), err)
	}
	if code != 0 {
		var doc struct {
			Error  string             `json:"error"`
			Code   string             `json:"code"`
			Status *supervisor.Status `json:"status"`
		}
		if json.Unmarshal(out, &doc) == nil && doc.Error != "" {
			return nil, &ctlError{Op: "session " + s.o.Episode + ": " + strings.Join(args, " "), Code: doc.Code, Msg: doc.Error, Status: doc.Status}
		}
		return nil, fmt.Errorf("session %s: ctl %s exited %d: %s", s.o.Episode, strings.Join(args, " "), code, errOut)
	}
	return out, nil
}

// SetClock sets the sandbox's wall clock to t with the in-sandbox binary's
// `clock` command, which computes the target from the sandbox's own uptime
// (guestclock), so the exec API's latency does not move where it lands.
// The command runs as stasis's user, which must be allowed to set the time.
func (s *Session) SetClock(ctx context.Context, t guestclock.Target) (guestclock.Fix, error) {
	var f guestclock.Fix
	if err := t.Check(); err != nil {
		return f, err
	}
	args := []string{"clock", "set"}
	if t.Continuous {
		args = append(args, "--pause-wall", strconv.FormatFloat(t.PauseWall, 'f', -1, 64), "--pause-uptime", strconv.FormatFloat(t.PauseUptime, 'f', -1, 64))
	} else {
		args = append(args, "--wall", strconv.FormatFloat(t.Wall, 'f', -1, 64))
	}
	out, code, errOut, err := s.stasis(ctx, args...)
	if err != nil {
		return f, fmt.Errorf("session %s: clock: %w", s.o.Episode, err)
	}
	if code != 0 {
		return f, fmt.Errorf("session %s: clock set exited %d: %s", s.o.Episode, code, errOut)
	}
	if err := json.Unmarshal(out, &f); err != nil {
		return f, fmt.Errorf("session %s: clock set printed %q: %w", s.o.Episode, out, err)
	}
	return f, nil
}

// Pause sends `pause n` and returns the acknowledgement.
func (s *Session) Pause(ctx context.Context, n int64) (*supervisor.Ack, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out, err := s.ctl(ctx, "pause", strconv.FormatInt(n, 10))
	if err != nil {
		return nil, err
	}
	var a supervisor.Ack
	if err := json.Unmarshal(out, &a); err != nil {
		return nil, fmt.Errorf("session %s: pause %d: bad acknowledgement %q: %w", s.o.Episode, n, out, err)
	}
	s.lastAck, s.inForce = &a, true
	return &a, nil
}

// Continue sends `continue n` and returns the acknowledgement.
func (s *Session) Continue(ctx context.Context, n int64) (*supervisor.Ack, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out, err := s.ctl(ctx, "continue", strconv.FormatInt(n, 10))
	if err != nil {
		if errors.Is(err, ErrExited) {
			// The sandbox may be deleted next (a failed restore is), and
			// its receipt with it: say here how the harness ended.
			return nil, fmt.Errorf("%w; the end of its log: %s", err, s.logTail(ctx, 2000))
		}
		return nil, err
	}
	var a supervisor.Ack
	if err := json.Unmarshal(out, &a); err != nil {
		return nil, fmt.Errorf("session %s: continue %d: bad acknowledgement %q: %w", s.o.Episode, n, out, err)
	}
	if s.lastAck != nil && s.lastAck.Seq == n {
		s.inForce = false
	}
	return &a, nil
}

// Status asks the supervisor for its status.
func (s *Session) Status(ctx context.Context) (*supervisor.Status, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.statusLocked(ctx)
}

func (s *Session) statusLocked(ctx context.Context) (*supervisor.Status, error) {
	out, err := s.ctl(ctx, "status")
	if err != nil {
		return nil, err
	}
	var st supervisor.Status
	if err := json.Unmarshal(out, &st); err != nil {
		return nil, fmt.Errorf("session %s: bad status %q: %w", s.o.Episode, out, err)
	}
	return &st, nil
}

// State is what a restore needs to know about a paused session: the fields
// of its checkpoint record other than the snapshot.
type State struct {
	Episode    string          `json:"episode"`
	Provider   string          `json:"provider"`
	Sandbox    string          `json:"sandbox"`
	Descriptor json.RawMessage `json:"descriptor,omitempty"`
	// Image is the sandbox's image digest (sandbox.Info.Image).
	Image          string          `json:"image,omitempty"`
	KeepsProcesses bool            `json:"keeps_processes"`
	Dir            string          `json:"dir"`
	PauseSeq       int64           `json:"pause_seq"`
	PauseMode      supervisor.Mode `json:"pause_mode"`
	PauseConfirmed bool            `json:"pause_confirmed"`
	Identity       proc.Identity   `json:"identity"`
	PauseWall      float64         `json:"pause_wall"`
	PauseUptime    float64         `json:"pause_uptime"`
	RelayDelivered *int64          `json:"relay_delivered,omitempty"`
	RelayPosition  *int64          `json:"relay_position,omitempty"`
	// RelayUnmatched: the relay did not know its ledger position at the
	// pause (supervisor.Ack.RelayUnmatched): an in-place restore matches
	// instead of cutting.
	RelayUnmatched bool `json:"relay_unmatched,omitempty"`
	// LedgerHead is the hash of the episode's ledger entry at LedgerCut
	// when the pause was taken ("" at 0, or with no relay).
	LedgerHead string `json:"ledger_head,omitempty"`
	// LedgerTip is the hash of the ledger's last record when the
	// snapshot was taken.
	LedgerTip      string   `json:"ledger_tip,omitempty"`
	HarnessSession string   `json:"harness_session,omitempty"`
	Attempt        int      `json:"attempt"`
	DeadlineLeftS  *float64 `json:"deadline_left_s,omitempty"`
	PauseFrozen    bool     `json:"pause_frozen,omitempty"`
}

// LedgerCut is where an in-place restore cuts the episode's ledger: the
// relay's settled position at the pause, or, in a record from before
// positions were recorded, its delivered count.
func (s State) LedgerCut() int64 {
	switch {
	case s.RelayPosition != nil:
		return *s.RelayPosition
	case s.RelayDelivered != nil:
		return *s.RelayDelivered
	}
	return 0
}

// LedgerAt is where the checkpoint left the episode's ledger, for the
// gateway's Restore and Fork.
func (s State) LedgerAt() relay.LedgerAt {
	return relay.LedgerAt{Position: s.LedgerCut(), Head: s.LedgerHead, Tip: s.LedgerTip, Unmatched: s.RelayUnmatched}
}

// ErrNoPause: CheckpointState was asked while no pause is in force.
var ErrNoPause = errors.New("no pause in force")

// CheckpointState returns the record of the pause in force.
func (s *Session) CheckpointState(ctx context.Context) (State, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.lastAck == nil || !s.inForce {
		return State{}, fmt.Errorf("session %s: %w; pause it first", s.o.Episode, ErrNoPause)
	}
	a := s.lastAck
	st := State{
		Episode: s.o.Episode, Provider: s.p.Name(), Sandbox: s.id, KeepsProcesses: s.p.Capabilities().KeepsProcesses,
		Dir: s.o.Dir, PauseSeq: a.Seq, PauseMode: a.Mode, PauseConfirmed: a.Confirmed, PauseFrozen: a.Frozen, Identity: a.Identity,
		PauseWall: a.Wall, PauseUptime: a.Uptime, RelayDelivered: a.RelayDelivered, RelayPosition: a.RelayPosition, RelayUnmatched: a.RelayUnmatched,
		HarnessSession: s.o.HarnessSession, Attempt: s.o.Attempt, DeadlineLeftS: a.DeadlineLeft,
	}
	if info, err := s.p.Get(ctx, s.id); err == nil {
		st.Descriptor, st.Image = info.Descriptor, info.Image
	}
	return st, nil
}

// Close ends the session. An owned sandbox is deleted (with everything in
// it); a borrowed one keeps running, and only the session's harness is
// stopped and its directory removed. Close is idempotent and safe to retry
// after an error.
func (s *Session) Close(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	if s.owned {
		if err := s.p.Delete(ctx, s.id); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			return fmt.Errorf("session %s: delete sandbox %s: %w", s.o.Episode, s.id, err)
		}
		s.closed = true
		return nil
	}
	if s.started {
		// Ends the harness gracefully; answers from the receipt if it
		// already ended.
		if _, err := s.ctl(ctx, "stop"); err != nil && !errors.Is(err, errdefs.ErrNotFound) && !errors.Is(err, errdefs.ErrExpired) {
			var ce *ctlError
			if !errors.As(err, &ce) {
				return err
			}
		}
	}
	res, err := s.p.Exec(ctx, s.id, sandbox.ExecRequest{Argv: []string{"rm", "-rf", "--", s.o.Dir}, User: s.control()})
	switch {
	case errors.Is(err, errdefs.ErrNotFound), errors.Is(err, errdefs.ErrExpired):
	case err != nil:
		return fmt.Errorf("session %s: remove %s: %w", s.o.Episode, s.o.Dir, err)
	case res.ExitCode != 0:
		return fmt.Errorf("session %s: remove %s: rm exited %d", s.o.Episode, s.o.Dir, res.ExitCode)
	}
	s.closed = true
	return nil
}
