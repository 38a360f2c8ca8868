package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"path"
	"sync"
	"syscall"
	"time"
	"unique"

	"github.com/spf13/pflag"

	"stasis/internal/guestclock"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/proc"
)

// binaryStandIn is what a simulated sandbox holds at the stasis binary's
// path: the provider runs the binary's commands itself.
var binaryStandIn = unique.Make("#!stasis (simulated: the sim provider runs the in-sandbox commands itself)\n")

// isStasis reports whether argv0 names the stasis binary in the sandbox.
func (b *box) isStasis(argv0 string) bool {
	if base := path.Base(argv0); base != "stasis" && base != "stasis-sandbox" {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	e, ok := b.fs[clean("/", argv0)]
	return ok && !e.isDir() && e.mode&0o111 != 0
}

// sup is a simulated supervisor: the real state machine over a harness
// that runs nothing. Every call on the machine is made under mu, as the
// real server makes them under its lock.
type sup struct {
	mu    sync.Mutex
	dir   string
	relay bool
	m     *supervisor.Machine
	h     *harness
	timer *time.Timer
	done  chan struct{} // closed once the machine has exited or the sandbox is gone
	ended bool
	dead  bool // the sandbox is gone: the supervisor with it
	box   *box // nil in a snapshot's copy
}

// harness is the simulated harness tree: one process that runs until it
// is terminated or killed; it stops, continues and is killed at once.
type harness struct {
	s       *sup
	pid     func() int
	gen     int
	running bool
}

func (h *harness) Launch(gen int, argv []string) (int, error) {
	if len(argv) == 0 {
		return 0, errors.New("no harness command")
	}
	h.gen, h.running = gen, true
	return h.pid(), nil
}

func (h *harness) StopTree(time.Duration) (bool, string, error)   { return true, "", nil }
func (h *harness) ContTree() error                                { return nil }
func (h *harness) FreezeTree(time.Duration) (bool, string, error) { return true, "", nil }
func (h *harness) ThawTree() error                                { return nil }

// Terminate ends the harness as SIGTERM would: it exits (asynchronously,
// as a process's exit reaches the real supervisor).
func (h *harness) Terminate() error {
	if h.running {
		gen, s := h.gen, h.s
		go s.harnessExited(gen, -int(syscall.SIGTERM))
	}
	return nil
}

func (h *harness) KillTree() ([]int, error) {
	h.running = false
	return nil, nil
}

// relayGate is the relay of a supervisor started with --relay-*: the
// simulated harness makes no model call, so none was ever delivered.
type relayGate struct{}

func (relayGate) Hold() (supervisor.Held, error) { return supervisor.Held{}, nil }
func (relayGate) Release() error                 { return nil }
func (relayGate) Flush(context.Context) error    { return nil }

// clock is the guest's: uptime from the sandbox's boot (a fork continues
// its snapshot's), wall time the host's moved by `clock set`.
type clock struct{ b *box }

func (c clock) Now() time.Time  { return time.Unix(0, 0).Add(time.Since(c.b.boot)) }
func (c clock) Wall() float64   { return float64(time.Now().Add(c.b.wallOffset()).UnixNano()) / 1e9 }
func (c clock) Uptime() float64 { return time.Since(c.b.boot).Seconds() }

func (b *box) wallOffset() time.Duration { return time.Duration(b.wallOff.Load()) }

// pid hands out the sandbox's next process id.
func (b *box) pid() int { return int(b.nextPID.Add(1)) }

// after re-arms the machine's timer, or marks it ended (s.mu held).
func (s *sup) after() {
	if s.m.Exited() {
		if !s.ended {
			s.ended = true
			close(s.done)
		}
		if s.timer != nil {
			s.timer.Stop()
		}
		return
	}
	wake := s.m.NextWake()
	if wake.IsZero() {
		if s.timer != nil {
			s.timer.Stop()
		}
		return
	}
	d := wake.Sub(clock{s.h.box()}.Now())
	if s.timer == nil {
		s.timer = time.AfterFunc(d, s.tick)
	} else {
		s.timer.Reset(d)
	}
}

func (h *harness) box() *box { return h.s.box }

func (s *sup) tick() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dead || s.m.Exited() {
		return
	}
	s.m.Tick()
	s.after()
}

func (s *sup) harnessExited(gen, code int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dead {
		return
	}
	_ = s.m.HarnessExited(gen, code) // an earlier launch's exit changes nothing
	s.after()
}

// kill ends the supervisor with its sandbox.
func (s *sup) kill() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.dead = true
	if s.timer != nil {
		s.timer.Stop()
	}
	if !s.ended {
		s.ended = true
		close(s.done)
	}
}

// frozen is a copy of the supervisor for a snapshot, driving nothing.
func (s *sup) frozen() *sup {
	s.mu.Lock()
	defer s.mu.Unlock()
	f := &sup{dir: s.dir, relay: s.relay, h: &harness{gen: s.h.gen, running: s.h.running}}
	f.m = s.m.Clone(nil, nil, nil)
	return f
}

// thaw starts a snapshot's supervisor copy in fork b, where it goes on
// from its state at the snapshot.
func (f *sup) thaw(b *box) *sup {
	s := &sup{dir: f.dir, relay: f.relay, done: make(chan struct{})}
	s.h = &harness{s: s, pid: b.pid, gen: f.h.gen, running: f.h.running}
	var gate supervisor.Gate
	if s.relay {
		gate = relayGate{}
	}
	s.m = f.m.Clone(s.h, gate, clock{b})
	s.box = b
	s.mu.Lock()
	s.after()
	s.mu.Unlock()
	return s
}

// stasisCmd runs an in-sandbox stasis command: supervise (background
// only), ctl and clock set. It returns the exit status.
func (b *box) stasisCmd(ctx context.Context, args []string, background bool, stdout, stderr io.Writer) (int, int) {
	if len(args) == 0 {
		fmt.Fprintln(stderr, "stasis (simulated): give a command: supervise, ctl or clock set")
		return 2, 0
	}
	switch args[0] {
	case "supervise":
		return b.supervise(args[1:], background, stderr)
	case "ctl":
		return b.ctl(ctx, args[1:], stdout, stderr), 0
	case "clock":
		return b.clockSet(args[1:], stdout, stderr), 0
	}
	fmt.Fprintf(stderr, "stasis %s: the sim provider runs only supervise, ctl and clock set of the in-sandbox binary\n", args[0])
	return 2, 0
}

// supervise starts a simulated supervisor on the flags the real one
// takes; it returns the exit status and the supervisor's pid.
func (b *box) supervise(args []string, background bool, stderr io.Writer) (int, int) {
	fl := pflag.NewFlagSet("supervise", pflag.ContinueOnError)
	fl.SetOutput(stderr)
	var (
		dir, mode, resume, relayListen, relayUpstream, relayToken, logFormat, logLevel, harnessHome, cgroupRoot string
		deadline, confirm, grace, heartbeat                                                                     time.Duration
		harnessUID, harnessGID                                                                                  int
		freeze                                                                                                  bool
	)
	fl.StringVar(&dir, "dir", "", "")
	fl.StringVar(&mode, "mode", "stop", "")
	fl.StringVar(&cgroupRoot, "cgroup-root", "", "")
	fl.BoolVar(&freeze, "freeze", false, "")
	fl.DurationVar(&deadline, "deadline", 0, "")
	fl.DurationVar(&confirm, "stop-confirm-timeout", 5*time.Second, "")
	fl.DurationVar(&grace, "grace", 10*time.Second, "")
	fl.StringVar(&resume, "resume-cmd", "", "")
	fl.StringVar(&relayListen, "relay-listen", "", "")
	fl.StringVar(&relayUpstream, "relay-upstream", "", "")
	fl.StringVar(&relayToken, "relay-token-file", "", "")
	fl.DurationVar(&heartbeat, "relay-heartbeat", 0, "")
	fl.IntVar(&harnessUID, "harness-uid", 0, "")
	fl.IntVar(&harnessGID, "harness-gid", 0, "")
	fl.StringVar(&harnessHome, "harness-home", "", "")
	fl.StringVar(&logFormat, "log-format", "text", "")
	fl.StringVar(&logLevel, "log-level", "info", "")
	if err := fl.Parse(args); err != nil {
		return 2, 0
	}
	argv := fl.Args()
	m, err := supervisor.ParseMode(mode)
	switch {
	case err != nil:
	case dir == "":
		err = errors.New("--dir is required")
	case len(argv) == 0:
		err = errors.New("give the harness command after --")
	case (relayListen != "") != (relayUpstream != "") || (relayListen != "") != (relayToken != ""):
		err = errors.New("--relay-listen, --relay-upstream and --relay-token-file go together")
	case fl.Changed("harness-uid"):
		err = errors.New("--harness-uid: a simulated sandbox has one user")
	case m == supervisor.ModeHoldFreeze || freeze:
		err = errors.New("hold+freeze: simulated sandboxes have no control groups")
	case !background:
		err = errors.New("the sim provider runs a supervisor in the background only")
	}
	if err != nil {
		fmt.Fprintf(stderr, "supervise: %v\n", err)
		return 2, 0
	}
	dir = clean("/", dir)
	cfg := supervisor.Config{Argv: argv, Mode: m, Deadline: deadline, Grace: grace, StopConfirmTimeout: confirm}
	if resume != "" {
		cfg.ResumeArgv = []string{"/bin/sh", "-c", resume}
	}
	s := &sup{dir: dir, relay: relayListen != "", done: make(chan struct{}), box: b}
	s.h = &harness{s: s, pid: b.pid}
	id := proc.Identity{PID: b.pid(), StartTime: uint64(time.Since(b.boot) / (10 * time.Millisecond))}
	var gate supervisor.Gate
	if s.relay {
		gate = relayGate{}
	}
	s.m = supervisor.NewMachine(cfg, id, s.h, gate, clock{b})

	b.mu.Lock()
	if old, ok := b.sups[dir]; ok && !old.isEnded() {
		b.mu.Unlock()
		fmt.Fprintf(stderr, "supervise: a supervisor already serves %s\n", dir)
		return 1, 0
	}
	if err := b.fs.mkdirAll(dir, 0o755, time.Now()); err != nil {
		b.mu.Unlock()
		fmt.Fprintf(stderr, "supervise: %v\n", err)
		return 1, 0
	}
	info, _ := json.Marshal(supervisor.Info{
		Identity: id, Dir: dir, Socket: path.Join(dir, supervisor.SocketFile), Mode: m, DeadlineS: deadline.Seconds(),
		GraceS: grace.Seconds(), StopConfirmTimeout: confirm.Seconds(), Argv: argv, ResumeArgv: cfg.ResumeArgv,
		StartedWall: clock{b}.Wall(), StartedUptime: clock{b}.Uptime(), Relay: s.relay, Version: "sim",
	})
	_ = b.fs.write(path.Join(dir, supervisor.InfoFile), info, 0o644, time.Now())
	b.sups[dir] = s
	b.mu.Unlock()

	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.m.Start(); err != nil {
		s.after()
		return 1, id.PID
	}
	s.after()
	return 0, id.PID
}

func (s *sup) isEnded() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ended
}

// do handles one control request as the real supervisor's server does.
func (s *sup) do(ctx context.Context, req supervisor.Request) supervisor.Response {
	s.mu.Lock()
	switch req.Op {
	case supervisor.OpStatus:
		st := s.m.Status()
		s.mu.Unlock()
		return supervisor.Response{OK: true, Status: &st}
	case supervisor.OpStop:
		s.m.Stop()
		s.after()
		s.mu.Unlock()
		select {
		case <-s.done:
		case <-ctx.Done():
			return supervisor.Response{Error: "stop: " + ctx.Err().Error(), Code: supervisor.CodeFailed}
		}
		s.mu.Lock()
		rc := s.m.Receipt()
		s.mu.Unlock()
		return supervisor.Response{OK: true, Receipt: rc}
	}
	defer s.mu.Unlock()
	var (
		ack *supervisor.Ack
		err error
	)
	if req.Op == supervisor.OpPause {
		ack, _, err = s.m.Pause(req.Seq)
	} else {
		ack, _, err = s.m.Continue(req.Seq)
	}
	s.after()
	if err != nil {
		var re *supervisor.RefusedError
		if errors.As(err, &re) {
			st := re.Status
			return supervisor.Response{Error: re.Msg, Code: supervisor.CodeRefused, Status: &st}
		}
		return supervisor.Response{Error: err.Error(), Code: supervisor.CodeFailed}
	}
	return supervisor.Response{OK: true, Ack: ack}
}

// ctl is `stasis ctl --dir DIR [--wait D] (pause N | continue N | status
// | stop)`: the same output and exit status as the real one.
func (b *box) ctl(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fl := pflag.NewFlagSet("ctl", pflag.ContinueOnError)
	fl.SetOutput(stderr)
	var dir string
	var wait time.Duration
	fl.StringVar(&dir, "dir", "", "")
	fl.DurationVar(&wait, "wait", 0, "")
	if err := fl.Parse(args); err != nil {
		return 2
	}
	print := func(v any) {
		out, _ := json.MarshalIndent(v, "", "  ")
		fmt.Fprintln(stdout, string(out))
	}
	if dir == "" {
		fmt.Fprintln(stderr, "--dir is required: the supervisor's session directory")
		return 2
	}
	req, err := ctlRequest(fl.Args())
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 2
	}
	dir = clean("/", dir)
	find := func() *sup {
		b.mu.Lock()
		defer b.mu.Unlock()
		return b.sups[dir]
	}
	s := find()
	for deadline := time.Now().Add(wait); s == nil && time.Now().Before(deadline); s = find() {
		select {
		case <-ctx.Done():
			deadline = time.Time{}
		case <-time.After(5 * time.Millisecond): // poll interval, bounded by --wait
		}
	}
	if s == nil {
		print(map[string]string{"error": fmt.Sprintf("%v in %s: no control socket and no %s", supervisor.ErrNoSupervisor, dir, supervisor.ReceiptFile), "code": supervisor.CodeUnreachable})
		return 1
	}
	r := s.do(ctx, req)
	if !r.OK {
		doc := map[string]any{"error": r.Error, "code": r.Code}
		if r.Status != nil {
			doc["status"] = r.Status
		}
		print(doc)
		if r.Code == supervisor.CodeRefused || r.Code == supervisor.CodeInvalid {
			return 2
		}
		return 1
	}
	switch {
	case r.Ack != nil:
		print(r.Ack)
		b.writeAck(dir, r.Ack)
	case r.Status != nil:
		print(r.Status)
	case r.Receipt != nil:
		print(r.Receipt)
		b.writeFile(path.Join(dir, supervisor.ReceiptFile), r.Receipt)
	}
	return 0
}

// writeAck keeps an acknowledgement in DIR/acks, as the real supervisor does.
func (b *box) writeAck(dir string, a *supervisor.Ack) {
	b.writeFile(path.Join(dir, supervisor.AcksDir, fmt.Sprintf("%d.%s.json", a.Seq, a.Op)), a)
}

func (b *box) writeFile(name string, v any) {
	data, _ := json.Marshal(v)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.dead {
		return
	}
	now := time.Now()
	if b.fs.mkdirAll(path.Dir(name), 0o755, now) == nil {
		_ = b.fs.write(name, data, 0o644, now)
	}
}

// ctlRequest parses ctl's arguments, then checks the request as the
// supervisor's server would (supervisor.ParseRequest).
func ctlRequest(args []string) (supervisor.Request, error) {
	if len(args) == 0 || len(args) > 2 {
		return supervisor.Request{}, errors.New("use pause N, continue N, status or stop")
	}
	req := map[string]any{"op": args[0]}
	if len(args) == 2 {
		req["seq"] = json.RawMessage(args[1])
		if !json.Valid([]byte(args[1])) {
			return supervisor.Request{}, fmt.Errorf("%s: sequence number %q must be a positive integer", args[0], args[1])
		}
	}
	line, _ := json.Marshal(req)
	r, err := supervisor.ParseRequest(line)
	if err != nil {
		return r, err
	}
	if (r.Op == supervisor.OpStatus || r.Op == supervisor.OpStop) && len(args) != 1 {
		return r, fmt.Errorf("%s takes no argument", r.Op)
	}
	return r, nil
}

// clockSet is `stasis clock set (--pause-wall W --pause-uptime U |
// --wall T)`: it moves the guest's wall clock, computing the continuous
// target from the guest's uptime as the real one does.
func (b *box) clockSet(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] != "set" {
		fmt.Fprintln(stderr, "clock: use clock set")
		return 2
	}
	fl := pflag.NewFlagSet("clock set", pflag.ContinueOnError)
	fl.SetOutput(stderr)
	var pauseWall, pauseUptime, wall float64
	fl.Float64Var(&pauseWall, "pause-wall", 0, "")
	fl.Float64Var(&pauseUptime, "pause-uptime", 0, "")
	fl.Float64Var(&wall, "wall", 0, "")
	if err := fl.Parse(args[1:]); err != nil {
		return 2
	}
	cont := fl.Changed("pause-wall") || fl.Changed("pause-uptime")
	if cont == fl.Changed("wall") || (cont && !(fl.Changed("pause-wall") && fl.Changed("pause-uptime"))) {
		fmt.Fprintln(stderr, "clock set: give --pause-wall and --pause-uptime, or --wall")
		return 2
	}
	t := guestclock.Target{Continuous: cont, PauseWall: pauseWall, PauseUptime: pauseUptime, Wall: wall}
	if err := t.Check(); err != nil {
		fmt.Fprintf(stderr, "clock set: %v\n", err)
		return 2
	}
	c := clock{b}
	f := guestclock.Fix{Uptime: c.Uptime(), Before: c.Wall()}
	want, err := t.At(f.Uptime)
	if err != nil {
		fmt.Fprintf(stderr, "clock set: %v\n", err)
		return 1
	}
	host := float64(time.Now().UnixNano()) / 1e9
	b.wallOff.Store(int64(math.Round((want - host) * 1e9)))
	f.After = want
	out, _ := json.Marshal(f)
	fmt.Fprintf(stdout, "%s\n", out)
	return 0
}
