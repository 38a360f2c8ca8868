package supervisor

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"stasis/internal/proc"
)

// ShimArg is the hidden first argument with which the stasis binary runs as
// the shim between the supervisor and the harness.
const ShimArg = "__shim"

// exitEvent reports the end of launch gen's harness.
type exitEvent struct {
	gen  int
	code int
	err  error
}

// procLayer is the real Process: it launches each harness through a shim
// (see RunShim), and finds the harness tree as every descendant of the
// supervisor other than the shim, whatever session or group they moved to.
type procLayer struct {
	self    int
	exe     string
	timeout time.Duration // bound on KillTree
	exits   chan exitEvent
	harness *HarnessUser // the harness's user, nil for the supervisor's own
	freezer *freezer     // the harness's control group (hold+freeze), or nil

	mu         sync.Mutex
	shimPID    int
	harnessPID int
	reported   chan struct{} // closed once the shim has reported the harness's end
	stopped    []proc.Identity
}

func newProcLayer(harness *HarnessUser) (*procLayer, error) {
	if err := SetSubreaper(); err != nil {
		return nil, err
	}
	p := &procLayer{
		self:    os.Getpid(),
		exe:     "/proc/self/exe",
		timeout: 10 * time.Second,
		exits:   make(chan exitEvent, 4),
		harness: harness,
	}
	go reapForever()
	return p, nil
}

// SetSubreaper makes the calling process a child subreaper: orphans below it
// are re-parented to it instead of to init, so it can find and reap them.
func SetSubreaper() error {
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("become child subreaper: %w", err)
	}
	return nil
}

// reapForever reaps every child of this process as it ends: the shim and any
// orphan re-parented here. Exit statuses travel by the shim's status pipe,
// not by wait, so nothing is lost by reaping them here.
func reapForever() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGCHLD)
	for {
		reapAll(nil)
		<-ch
	}
}

// reapAll reaps every child that has ended, telling reaped (when not nil)
// of each.
func reapAll(reaped func(pid int, ws unix.WaitStatus)) {
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG|unix.WALL, nil)
		if err == unix.EINTR {
			continue
		}
		if pid <= 0 || err != nil {
			return
		}
		if reaped != nil {
			reaped(pid, ws)
		}
	}
}

func (p *procLayer) Launch(gen int, argv []string) (int, error) {
	if len(argv) == 0 {
		return 0, errors.New("no harness command")
	}
	lifeR, lifeW, err := os.Pipe()
	if err != nil {
		return 0, err
	}
	statR, statW, err := os.Pipe()
	if err != nil {
		lifeR.Close()
		lifeW.Close()
		return 0, err
	}
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		return 0, err
	}
	defer devnull.Close()
	cmd := p.shimCmd(argv, devnull, lifeR, statW)
	err = cmd.Start()
	lifeR.Close()
	statW.Close()
	if err != nil {
		lifeW.Close()
		statR.Close()
		return 0, fmt.Errorf("start shim: %w", err)
	}
	shimPID := cmd.Process.Pid
	_ = cmd.Process.Release() // reaped by reapForever
	br := bufio.NewReader(statR)
	_ = statR.SetReadDeadline(time.Now().Add(30 * time.Second))
	line, err := br.ReadString('\n')
	_ = statR.SetReadDeadline(time.Time{})
	fail := func(e error) (int, error) {
		lifeW.Close() // the shim kills whatever it started and exits
		statR.Close()
		return 0, e
	}
	if err != nil {
		return fail(fmt.Errorf("shim (pid %d) did not report the harness start: %v", shimPID, err))
	}
	word, rest, _ := strings.Cut(strings.TrimSpace(line), " ")
	switch word {
	case "pid":
	case "error":
		return fail(errors.New(rest))
	default:
		return fail(fmt.Errorf("shim said %q", line))
	}
	pid, err := strconv.Atoi(rest)
	if err != nil {
		return fail(fmt.Errorf("shim said %q", line))
	}
	reported := make(chan struct{})
	p.mu.Lock()
	p.shimPID = shimPID
	p.harnessPID = pid
	p.reported = reported
	p.mu.Unlock()
	go p.awaitExit(gen, br, lifeW, statR, reported)
	return pid, nil
}

// shimCmd is the command of the shim that starts argv, with the lifeline's
// reading end and the status pipe's writing end as its fds 3 and 4.
func (p *procLayer) shimCmd(argv []string, devnull, lifeR, statW *os.File) *exec.Cmd {
	cmd := &exec.Cmd{
		Path:       p.exe,
		Args:       append([]string{"stasis-shim", ShimArg, "--"}, argv...),
		Stdin:      devnull,
		Stdout:     os.Stdout,
		Stderr:     os.Stderr,
		ExtraFiles: []*os.File{lifeR, statW},
		// Its own process group: a signal to the supervisor's group must not
		// take the shim down with it, or the lifeline cleanup could not run.
		SysProcAttr: &syscall.SysProcAttr{Setpgid: true},
	}
	if p.harness != nil || p.freezer != nil {
		cmd.Env = os.Environ()
	}
	if p.harness != nil {
		u := fmt.Sprintf("%s=%d:%d", ShimHarnessEnv, p.harness.UID, p.harness.GID)
		if p.harness.Home != "" {
			u += ":" + p.harness.Home
		}
		cmd.Env = append(cmd.Env, u)
	}
	if p.freezer != nil {
		cmd.Env = append(cmd.Env, ShimCgroupEnv+"="+p.freezer.dir)
	}
	return cmd
}

// awaitExit reads the harness's end from the shim's status pipe (closing
// reported as it does), sends it as generation gen's exit, and holds the
// lifeline open until the shim is gone (killed by KillTree).
func (p *procLayer) awaitExit(gen int, br *bufio.Reader, lifeW, statR *os.File, reported chan struct{}) {
	defer lifeW.Close()
	defer statR.Close()
	ev := exitEvent{gen: gen}
	line, err := br.ReadString('\n')
	close(reported)
	word, rest, _ := strings.Cut(strings.TrimSpace(line), " ")
	n, convErr := strconv.Atoi(rest)
	switch {
	case err != nil:
		ev.code, ev.err = -1, fmt.Errorf("shim ended without reporting the harness's exit")
	case word == "exit" && convErr == nil:
		ev.code = n
	case word == "signal" && convErr == nil:
		ev.code = -n
	default:
		ev.code, ev.err = -1, fmt.Errorf("shim said %q", line)
	}
	p.exits <- ev
	_, _ = br.ReadString('\n')
}

// tree lists the harness tree: every descendant of the supervisor but the
// shim.
func (p *procLayer) tree() ([]proc.Stat, error) {
	desc, err := proc.Descendants(p.self)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	shim := p.shimPID
	p.mu.Unlock()
	var out []proc.Stat
	for _, s := range desc {
		if s.PID != shim {
			out = append(out, s)
		}
	}
	return out, nil
}

func (p *procLayer) StopTree(timeout time.Duration) (bool, string, error) {
	deadline := time.Now().Add(timeout)
	sent := map[int]proc.Identity{}
	defer func() {
		ids := make([]proc.Identity, 0, len(sent))
		for _, id := range sent {
			ids = append(ids, id)
		}
		p.mu.Lock()
		p.stopped = ids
		p.mu.Unlock()
	}()
	wait := 20 * time.Microsecond
	var lastStragglers []string // from the last round that checked states
	for {
		tree, err := p.tree()
		if err != nil {
			return false, "", err
		}
		fresh := false
		for _, s := range tree {
			if id, ok := sent[s.PID]; ok && id.StartTime == s.StartTime {
				continue
			}
			fresh = true
			sent[s.PID] = proc.Identity{PID: s.PID, StartTime: s.StartTime}
			_ = unix.Kill(s.PID, unix.SIGSTOP)
		}
		var stragglers []string
		if !fresh {
			inD := map[int]bool{}
			for _, s := range tree {
				states, err := proc.TaskStates(s.PID)
				if err != nil {
					continue // gone
				}
				for _, st := range states {
					if !proc.Stopped(st) {
						stragglers = append(stragglers, fmt.Sprintf("pid %d (%s) in state %c", s.PID, s.Comm, st))
						inD[s.PID] = inD[s.PID] || st == 'D'
						break
					}
				}
			}
			if len(stragglers) == 0 {
				return true, "", nil
			}
			lastStragglers = stragglers
			// A parent in vfork (dash, posix_spawn) waits in D until its
			// child execs; if the SIGSTOP caught the child before its exec,
			// neither would ever move. Let such children run on: the next
			// round stops them again, by then (usually) exec'd, and the
			// parent, released, stops on the SIGSTOP it already has.
			for _, s := range tree {
				if inD[s.PPID] && (s.State == 'T' || s.State == 't') {
					_ = unix.Kill(s.PID, unix.SIGCONT)
					delete(sent, s.PID)
				}
			}
		}
		if time.Now().After(deadline) {
			if len(stragglers) == 0 {
				stragglers = lastStragglers
			}
			if len(stragglers) == 0 {
				stragglers = []string{"the tree kept forking"}
			}
			sort.Strings(stragglers)
			return false, fmt.Sprintf("not all stopped within %s: %s", timeout, strings.Join(stragglers, ", ")), nil
		}
		nap(wait) // poll interval, bounded by the deadline above
		if wait < 2*time.Millisecond {
			wait *= 2
		}
	}
}

func (p *procLayer) ContTree() error {
	p.mu.Lock()
	ids := p.stopped
	p.stopped = nil
	p.mu.Unlock()
	for _, id := range ids {
		if s, err := proc.ReadStat(id.PID); err == nil && s.StartTime == id.StartTime {
			_ = unix.Kill(id.PID, unix.SIGCONT)
		}
	}
	return nil
}

func (p *procLayer) Terminate() error {
	p.mu.Lock()
	pid := p.harnessPID
	p.mu.Unlock()
	if pid <= 0 {
		return nil
	}
	if err := unix.Kill(-pid, unix.SIGTERM); err == unix.ESRCH {
		_ = unix.Kill(pid, unix.SIGTERM)
	}
	return nil
}

func (p *procLayer) KillTree() ([]int, error) {
	p.mu.Lock()
	shim, reported := p.shimPID, p.reported
	p.mu.Unlock()
	if shim > 0 {
		// The harness tree first, so that the shim can still report how the
		// harness ended; then everything, the shim included.
		_, _ = killBelowExcept(p.self, shim, p.timeout)
		select {
		case <-reported:
		case <-time.After(2 * time.Second):
		}
	}
	left, err := killBelow(p.self, p.timeout)
	p.mu.Lock()
	p.shimPID, p.harnessPID, p.stopped = 0, 0, nil
	p.mu.Unlock()
	return left, err
}

// killBelow sends SIGKILL to every descendant of root until none is left (the
// caller, a subreaper, reaps them) or timeout passes; it returns the PIDs
// still there at the end.
func killBelow(root int, timeout time.Duration) ([]int, error) {
	return killBelowExcept(root, 0, timeout)
}

// killBelowExcept is killBelow sparing one process (but not its descendants).
func killBelowExcept(root, spare int, timeout time.Duration) ([]int, error) {
	deadline := time.Now().Add(timeout)
	wait := 20 * time.Microsecond
	for {
		all, err := proc.Descendants(root)
		if err != nil {
			return nil, err
		}
		tree := all[:0]
		for _, s := range all {
			if s.PID != spare {
				tree = append(tree, s)
			}
		}
		if len(tree) == 0 {
			return nil, nil
		}
		var pids []int
		for _, s := range tree {
			_ = unix.Kill(s.PID, unix.SIGKILL)
			pids = append(pids, s.PID)
		}
		reapAll(nil)
		if time.Now().After(deadline) {
			sort.Ints(pids)
			return pids, nil
		}
		nap(wait) // poll interval, bounded by the deadline above
		if wait < 5*time.Millisecond {
			wait *= 2
		}
	}
}

// nap waits for d. Go's timers can be as coarse as a millisecond on some
// machines, so short polling intervals use nanosleep(2) directly, which
// blocks this goroutine's thread for about d.
func nap(d time.Duration) {
	if d >= time.Millisecond {
		time.Sleep(d)
		return
	}
	ts := unix.NsecToTimespec(d.Nanoseconds())
	_ = unix.Nanosleep(&ts, nil)
}

// FreezeTree freezes the harness's control group (hold+freeze).
func (p *procLayer) FreezeTree(timeout time.Duration) (bool, string, error) {
	if p.freezer == nil {
		return false, "", errors.New("no control group to freeze: the supervisor was not started in hold+freeze mode")
	}
	return p.freezer.Freeze(timeout)
}

// ThawTree thaws the harness's control group.
func (p *procLayer) ThawTree() error {
	if p.freezer == nil {
		return nil
	}
	return p.freezer.Thaw()
}
