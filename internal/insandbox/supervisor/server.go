package supervisor

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"stasis/internal/proc"
	"stasis/internal/storage/atomicfile"
)

// File names inside the session directory.
const (
	InfoFile    = "supervisor.json"
	SocketFile  = "control.sock"
	ReceiptFile = "receipt.json"
	AcksDir     = "acks"
	RunsDir     = "runs" // earlier runs' files, moved aside by a new supervisor (the last KeptRuns)
)

// Info is written to DIR/supervisor.json when the supervisor starts.
type Info struct {
	Identity           proc.Identity `json:"identity"`
	Dir                string        `json:"dir"`
	Socket             string        `json:"socket"`
	Mode               Mode          `json:"mode"`
	DeadlineS          float64       `json:"deadline_s"`
	GraceS             float64       `json:"grace_s"`
	StopConfirmTimeout float64       `json:"stop_confirm_timeout_s"`
	Argv               []string      `json:"argv"`
	ResumeArgv         []string      `json:"resume_argv,omitempty"`
	StartedWall        float64       `json:"started_wall"`
	StartedUptime      float64       `json:"started_uptime"`
	Relay              bool          `json:"relay"`
	Version            string        `json:"version"`
	// HarnessUser is the user the harness runs as, when not the
	// supervisor's own (`--harness-uid`).
	HarnessUser *HarnessUser `json:"harness_user,omitempty"`
}

// Options configure Run.
type Options struct {
	Dir     string
	Config  Config
	Gate    Gate // nil when no relay is attached
	Logger  *slog.Logger
	Version string
	// Harness, when set, runs the harness as that user, jailed (see
	// HarnessUser), and Run refuses to start unless the session directory,
	// its control socket and every file of Closed are closed to it.
	Harness *HarnessUser
	// CgroupRoot is the cgroup v2 file system hold+freeze makes the
	// harness's control group in (default CgroupRoot).
	CgroupRoot string
	// Closed are the other files the harness must not reach: the relay's
	// token file and its upstream socket. Checked only with Harness.
	Closed []ClosedFile
}

// ClosedFile is a file that must be closed to the harness user.
type ClosedFile struct {
	Path   string
	Access Access // what the harness must not do to it
	What   string // how messages name it ("--relay-token-file")
}

// realClock is the production Clock.
type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }
func (realClock) Wall() float64  { return float64(time.Now().UnixNano()) / 1e9 }
func (realClock) Uptime() float64 {
	u, err := proc.Uptime()
	if err != nil {
		return -1
	}
	return u
}

type server struct {
	dir    string
	log    *slog.Logger
	m      *Machine
	wg     sync.WaitGroup // connections being served
	mu     sync.Mutex     // guards m, unsafe and pending
	kick   chan struct{}
	done   chan struct{} // closed once the machine has exited and the receipt is on disk
	uid    int
	unsafe map[string]bool // ack files whose write failed, to retry on a repeat
	// pending is a hold's acknowledgement not yet in its file: it is
	// written after the reply has gone (by the connection that made it),
	// or first thing by the next request, whichever takes mu first.
	pending *pendingAck
}

type pendingAck struct {
	path string
	ack  *Ack
}

// flushLocked writes the pending acknowledgement, if any; s.mu is held.
// A failed write is logged and retried when the request is repeated.
func (s *server) flushLocked() {
	p := s.pending
	if p == nil {
		return
	}
	s.pending = nil
	if err := atomicfile.ReplaceJSON(p.path, p.ack, 0o644); err != nil {
		s.unsafe[p.path] = true
		s.log.Error("write acknowledgement", "path", p.path, "err", err)
		return
	}
	delete(s.unsafe, p.path)
}

// Run is `stasis supervise`: it launches the harness, serves the control
// socket until the harness has ended and its tree is gone, writes the
// receipt and returns it. Cancelling ctx (SIGTERM or SIGINT to the
// supervisor) ends the harness as a stop request does.
func Run(ctx context.Context, o Options) (*Receipt, error) {
	log := o.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	dir, id, pl, err := o.setUp()
	if err != nil {
		return nil, err
	}
	if pl.freezer != nil {
		defer func() {
			if err := pl.freezer.Remove(); err != nil {
				log.Warn("the harness's control group stays", "err", err)
			}
		}()
	}
	ln, err := o.listen(dir)
	if err != nil {
		return nil, err
	}
	defer ln.Close()
	clock := realClock{}
	info := Info{
		Identity: id, Dir: dir, Socket: filepath.Join(dir, SocketFile), Mode: o.Config.Mode,
		DeadlineS: o.Config.Deadline.Seconds(), GraceS: o.Config.Grace.Seconds(),
		StopConfirmTimeout: o.Config.StopConfirmTimeout.Seconds(),
		Argv:               o.Config.Argv, ResumeArgv: o.Config.ResumeArgv,
		StartedWall: clock.Wall(), StartedUptime: clock.Uptime(), Relay: o.Gate != nil, Version: o.Version,
		HarnessUser: o.Harness,
	}
	if err := atomicfile.WriteJSON(filepath.Join(dir, InfoFile), info, 0o644); err != nil {
		return nil, err
	}
	s := &server{
		dir: dir, log: log, kick: make(chan struct{}, 1), done: make(chan struct{}),
		uid: os.Getuid(), unsafe: map[string]bool{},
		m: NewMachine(o.Config, id, pl, o.Gate, clock),
	}
	go s.serve(ln)

	s.mu.Lock()
	if err := s.m.Start(); err != nil {
		log.Error("launch failed", "argv", o.Config.Argv, "err", err)
	} else {
		log.Info("harness launched", "pid", s.m.harnessPID, "mode", o.Config.Mode, "identity", id.String())
	}
	s.mu.Unlock()
	s.run(ctx, pl.exits, o.Config.Grace)
	return s.finish(o.Gate, ln)
}

// setUp checks the options (the mode defaults to stop) and makes what the
// harness is launched with: the session directory (dir, absolute), the
// supervisor's identity and the process layer, with the harness's control
// group for hold+freeze (to be removed at the end).
func (o *Options) setUp() (dir string, id proc.Identity, pl *procLayer, err error) {
	if len(o.Config.Argv) == 0 {
		return "", id, nil, errors.New("no harness command: give it after --")
	}
	if o.Config.Mode == "" {
		o.Config.Mode = ModeStop
	}
	// Always, with or without a harness user: a process of the same uid
	// without CAP_SYS_PTRACE cannot trace this one or open its
	// /proc/PID/mem, environ or fd, and no core dump holds the relay's
	// token.
	if err := SetNotDumpable(); err != nil {
		return "", id, nil, err
	}
	if o.Harness != nil {
		if err := o.Harness.Check(); err != nil {
			return "", id, nil, err
		}
	}
	if dir, err = filepath.Abs(o.Dir); err != nil {
		return "", id, nil, err
	}
	if err := prepareDir(dir); err != nil {
		return "", id, nil, err
	}
	if id, err = proc.Self(); err != nil {
		return "", id, nil, fmt.Errorf("read own identity: %w", err)
	}
	if pl, err = newProcLayer(o.Harness); err != nil {
		return "", id, nil, err
	}
	if o.Config.Mode == ModeHoldFreeze {
		root := o.CgroupRoot
		if root == "" {
			root = CgroupRoot
		}
		if pl.freezer, err = newFreezer(root); err != nil {
			return "", id, nil, err
		}
	}
	return dir, id, pl, nil
}

// listen listens on the control socket in dir and, with a harness user,
// checks that the directory, the socket and the other closed files are
// closed to it.
func (o *Options) listen(dir string) (*net.UnixListener, error) {
	ln, err := listenUnix(filepath.Join(dir, SocketFile))
	if err != nil {
		return nil, err
	}
	if o.Harness != nil {
		if err := checkClosed(dir, *o.Harness, o.Closed); err != nil {
			_ = os.Remove(filepath.Join(dir, SocketFile))
			ln.Close()
			return nil, fmt.Errorf("the harness's uid %d could reach what is the supervisor's alone: %w", o.Harness.UID, err)
		}
	}
	return ln, nil
}

// run steps the machine on its timer, on the harness's exits, on requests
// (kick) and on ctx's end (a stop), until the harness has exited.
func (s *server) run(ctx context.Context, exits <-chan exitEvent, grace time.Duration) {
	stopAsked := false
	for {
		s.mu.Lock()
		if s.m.Exited() {
			s.mu.Unlock()
			break
		}
		wake := s.m.NextWake()
		s.mu.Unlock()
		var timer *time.Timer
		var timerC <-chan time.Time
		if !wake.IsZero() {
			timer = time.NewTimer(time.Until(wake))
			timerC = timer.C
		}
		ctxDone := ctx.Done()
		if stopAsked {
			ctxDone = nil
		}
		select {
		case <-timerC:
			s.mu.Lock()
			before := s.m.state
			s.m.Tick()
			if before == stRunning && s.m.state == stStopping {
				s.log.Warn("deadline reached; SIGTERM sent to the harness", "grace", grace)
			}
			s.mu.Unlock()
		case ev := <-exits:
			s.mu.Lock()
			if err := s.m.HarnessExited(ev.gen, ev.code); err == nil {
				s.log.Info("harness ended", "return_code", ev.code, "shim_err", ev.err)
			}
			s.mu.Unlock()
		case <-s.kick:
		case <-ctxDone:
			stopAsked = true
			s.log.Info("supervisor asked to end; stopping the harness")
			s.mu.Lock()
			s.m.Stop()
			s.mu.Unlock()
		}
		if timer != nil {
			timer.Stop()
		}
	}
}

// finish, once the harness has exited, has the gateway record the last
// settlements, writes the receipt, closes the control socket and lets the
// requests in flight answer.
func (s *server) finish(gate Gate, ln net.Listener) (*Receipt, error) {
	if gate != nil {
		// The harness has ended: before the receipt says so, the gateway
		// records what became of its last responses (otherwise they would
		// stay pending in the ledger, their settlements lost with this
		// process).
		fctx, cancel := context.WithTimeout(context.Background(), gateFlushTimeout)
		if err := gate.Flush(fctx); err != nil {
			s.log.Warn("the gateway did not record the last settlements: their ledger entries stay pending", "err", err)
		}
		cancel()
	}
	s.mu.Lock()
	s.flushLocked()
	rc := s.m.Receipt()
	s.mu.Unlock()
	werr := atomicfile.WriteJSON(filepath.Join(s.dir, ReceiptFile), rc, 0o644)
	_ = os.Remove(filepath.Join(s.dir, SocketFile))
	close(s.done)
	ln.Close()
	// Let requests in flight (a stop waiting for this receipt) answer.
	flushed := make(chan struct{})
	go func() { s.wg.Wait(); close(flushed) }()
	select {
	case <-flushed:
	case <-time.After(5 * time.Second):
	}
	s.log.Info("supervisor done", "cleanup_confirmed", rc.CleanupConfirmed, "timed_out", rc.TimedOut, "relaunches", rc.Relaunches)
	return rc, werr
}

// gateFlushTimeout bounds the wait, at the harness's end, for the gateway
// to record the relay's last settlements.
const gateFlushTimeout = 10 * time.Second

// checkClosed refuses a session directory, acknowledgements directory,
// control socket or other file of closed that the harness user could
// reach or replace.
func checkClosed(dir string, u HarnessUser, closed []ClosedFile) error {
	if err := CheckDirClosedTo(dir, u, "session directory"); err != nil {
		return err
	}
	if err := CheckDirClosedTo(filepath.Join(dir, AcksDir), u, "acknowledgements directory"); err != nil {
		return err
	}
	if err := CheckClosedTo(filepath.Join(dir, SocketFile), u, Connect, "control socket"); err != nil {
		return err
	}
	for _, c := range closed {
		if err := CheckClosedTo(c.Path, u, c.Access, c.What); err != nil {
			return err
		}
	}
	return nil
}

// prepareDir makes the session directory, refuses one that a live
// supervisor serves, and moves a finished run's files aside.
func prepareDir(dir string) error {
	if err := os.MkdirAll(filepath.Join(dir, AcksDir), 0o700); err != nil {
		return fmt.Errorf("session directory: %w", err)
	}
	b, err := os.ReadFile(filepath.Join(dir, InfoFile))
	if errors.Is(err, os.ErrNotExist) {
		_ = os.Remove(filepath.Join(dir, SocketFile))
		return nil
	}
	if err != nil {
		return fmt.Errorf("session directory: %w", err)
	}
	var old Info
	if json.Unmarshal(b, &old) == nil && old.Identity.PID > 0 && proc.Alive(old.Identity) {
		return fmt.Errorf("session directory %s is served by a running supervisor (pid %d); use another --dir or `stasis ctl --dir %s stop` first", dir, old.Identity.PID, dir)
	}
	dst := filepath.Join(dir, RunsDir, fmt.Sprintf("%d-%d", old.Identity.PID, old.Identity.StartTime))
	if err := os.MkdirAll(dst, 0o700); err != nil {
		return err
	}
	for _, n := range []string{InfoFile, ReceiptFile, AcksDir} {
		if err := os.Rename(filepath.Join(dir, n), filepath.Join(dst, n)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("move the earlier run's %s aside: %w", n, err)
		}
	}
	_ = os.Remove(filepath.Join(dir, SocketFile))
	pruneRuns(filepath.Join(dir, RunsDir), KeptRuns)
	return os.MkdirAll(filepath.Join(dir, AcksDir), 0o700)
}

// KeptRuns is how many earlier runs' files a session directory keeps: an
// episode restored again and again (each restore on a relaunching
// provider starts a new supervisor) would otherwise grow its sandbox, and
// every snapshot of it, by a run each time.
const KeptRuns = 8

// pruneRuns removes the oldest runs' directories beyond keep (by the time
// each was moved aside). A failure leaves them: it costs only space.
func pruneRuns(runs string, keep int) {
	ents, err := os.ReadDir(runs)
	if err != nil || len(ents) <= keep {
		return
	}
	type run struct {
		name string
		at   time.Time
	}
	var rs []run
	for _, e := range ents {
		if fi, err := e.Info(); err == nil && e.IsDir() {
			rs = append(rs, run{e.Name(), fi.ModTime()})
		}
	}
	sort.Slice(rs, func(i, j int) bool {
		if !rs[i].at.Equal(rs[j].at) {
			return rs[i].at.After(rs[j].at)
		}
		return rs[i].name > rs[j].name
	})
	for _, r := range rs[min(keep, len(rs)):] {
		_ = os.RemoveAll(filepath.Join(runs, r.name))
	}
}

// sockPath returns a path for a unix socket that fits the kernel's 108-byte
// limit: long paths go through /proc/self/fd of an open directory. The
// returned closer must be called after bind or connect.
func sockPath(path string) (string, func(), error) {
	if len(path) < 100 {
		return path, func() {}, nil
	}
	d, err := os.Open(filepath.Dir(path))
	if err != nil {
		return "", nil, err
	}
	return "/proc/self/fd/" + strconv.Itoa(int(d.Fd())) + "/" + filepath.Base(path), func() { d.Close() }, nil
}

func listenUnix(path string) (*net.UnixListener, error) {
	p, done, err := sockPath(path)
	if err != nil {
		return nil, err
	}
	defer done()
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: p, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("control socket %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(false)
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("control socket %s: %w", path, err)
	}
	return ln, nil
}

func (s *server) serve(ln *net.UnixListener) {
	for {
		c, err := ln.AcceptUnix()
		if err != nil {
			return
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.handle(c)
		}()
	}
}

func peerUID(c *net.UnixConn) (int, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return -1, err
	}
	var cred *unix.Ucred
	var cerr error
	err = raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	})
	if err != nil {
		return -1, err
	}
	if cerr != nil {
		return -1, cerr
	}
	return int(cred.Uid), nil
}

func (s *server) handle(c *net.UnixConn) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	reply := func(r Response) {
		b, _ := json.Marshal(r)
		_ = c.SetWriteDeadline(time.Now().Add(10 * time.Second))
		_, _ = c.Write(append(b, '\n'))
	}
	// Only the supervisor's own user and root may drive it: never the
	// harness, which runs as another user when it is jailed (and whose
	// socket mode 0600 already keeps it out; this holds if that fails).
	if uid, err := peerUID(c); err != nil || (uid != s.uid && uid != 0) {
		s.log.Warn("control connection refused", "peer_uid", uid, "err", err)
		reply(Response{Error: fmt.Sprintf("peer uid %d is neither the supervisor's uid %d nor root", uid, s.uid), Code: CodeDenied})
		return
	}
	line, err := bufio.NewReaderSize(io.LimitReader(c, MaxRequestBytes+1), MaxRequestBytes+1).ReadSlice('\n')
	if err != nil && !(errors.Is(err, io.EOF) && len(line) > 0) {
		if errors.Is(err, bufio.ErrBufferFull) {
			reply(Response{Error: fmt.Sprintf("request over the %d-byte limit", MaxRequestBytes), Code: CodeInvalid})
		} else {
			reply(Response{Error: "read request: " + err.Error(), Code: CodeInvalid})
		}
		return
	}
	req, err := ParseRequest(line)
	if err != nil {
		reply(Response{Error: err.Error(), Code: CodeInvalid})
		return
	}
	if req.Op == OpStop {
		_ = c.SetDeadline(time.Time{}) // the graceful end may take the grace period
	}
	reply(s.do(req))
	s.mu.Lock()
	s.flushLocked()
	s.mu.Unlock()
}

func (s *server) do(req Request) Response {
	defer func() {
		select {
		case s.kick <- struct{}{}:
		default:
		}
	}()
	s.mu.Lock()
	s.flushLocked()
	switch req.Op {
	case OpStatus:
		st := s.m.Status()
		s.mu.Unlock()
		return Response{OK: true, Status: &st}
	case OpStop:
		if !s.m.Exited() {
			s.log.Info("stop requested")
		}
		s.m.Stop()
		s.mu.Unlock()
		s.kickNow()
		<-s.done
		s.mu.Lock()
		rc := s.m.Receipt()
		s.mu.Unlock()
		return Response{OK: true, Receipt: rc}
	}
	var ack *Ack
	var fresh bool
	var err error
	if req.Op == OpPause {
		ack, fresh, err = s.m.Pause(req.Seq)
	} else {
		ack, fresh, err = s.m.Continue(req.Seq)
	}
	defer s.mu.Unlock()
	if err != nil {
		var re *RefusedError
		if errors.As(err, &re) {
			st := re.Status
			return Response{Error: re.Msg, Code: CodeRefused, Status: &st}
		}
		s.log.Error("request failed", "op", req.Op, "seq", req.Seq, "err", err)
		return Response{Error: err.Error(), Code: CodeFailed}
	}
	path := filepath.Join(s.dir, AcksDir, fmt.Sprintf("%d.%s.json", ack.Seq, ack.Op))
	if fresh || s.unsafe[path] {
		// A hold's acknowledgement is written after the reply, without
		// fsync: hold is only used where the snapshot keeps the processes,
		// so it keeps this supervisor (which writes it first thing after a
		// restore, if it had not yet) and the page cache with them, and the
		// host has the acknowledgement in the reply. Any later request
		// writes it first. A stop pause's is durable before the reply, as
		// a file-only snapshot or a crash of the machine needs.
		if ack.Mode.Holds() {
			s.pending = &pendingAck{path: path, ack: ack}
		} else {
			if err := atomicfile.WriteJSON(path, ack, 0o644); err != nil {
				s.unsafe[path] = true
				s.log.Error("write acknowledgement", "path", path, "err", err)
				return Response{Error: fmt.Sprintf("%s %d took effect but its acknowledgement could not be written (%v); repeat the request to retry the write", req.Op, req.Seq, err), Code: CodeFailed}
			}
			delete(s.unsafe, path)
		}
	}
	if fresh {
		s.log.Info(req.Op, "seq", ack.Seq, "mode", ack.Mode, "confirmed", ack.Confirmed, "note", ack.Note)
	}
	return Response{OK: true, Ack: ack}
}

func (s *server) kickNow() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}
