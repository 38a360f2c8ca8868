package supervisor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"time"
)

// Child is a `stasis supervise` process started by this process: the demo,
// the benchmark and the tests drive supervisors this way, exactly as a host
// does.
type Child struct {
	Dir  string
	Cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// SpawnOptions configure Spawn.
type SpawnOptions struct {
	Exe    string   // the stasis binary (or a test binary that acts as it)
	Env    []string // extra environment for the supervisor
	Dir    string
	Flags  []string // supervise flags besides --dir
	Argv   []string // harness command
	Stdout io.Writer
	Stderr io.Writer
	Wait   time.Duration // how long to wait for the control socket (default 10s)
}

// Spawn starts `stasis supervise --dir DIR FLAGS -- ARGV` and returns once
// its control socket answers.
func Spawn(ctx context.Context, o SpawnOptions) (*Child, error) {
	args := append([]string{"supervise", "--dir", o.Dir}, o.Flags...)
	args = append(append(args, "--"), o.Argv...)
	cmd := exec.Command(o.Exe, args...)
	cmd.Env = append(os.Environ(), o.Env...)
	cmd.Stdout, cmd.Stderr = o.Stdout, o.Stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start supervisor: %w", err)
	}
	c := &Child{Dir: o.Dir, Cmd: cmd, done: make(chan struct{})}
	go func() { c.err = cmd.Wait(); close(c.done) }()
	wait := o.Wait
	if wait == 0 {
		wait = 10 * time.Second
	}
	deadline := time.Now().Add(wait)
	for {
		r, err := Call(ctx, o.Dir, Request{Op: OpStatus})
		if err == nil && r.OK && r.Status.State != StateExited && r.Status.Identity.PID == cmd.Process.Pid {
			return c, nil
		}
		select {
		case <-c.done:
			// A harness that ends at once takes its supervisor with it; that
			// is a run, not a failure, when the receipt is this supervisor's.
			if rc, rerr := ReadReceipt(o.Dir); rerr == nil && rc.Identity.PID == cmd.Process.Pid {
				return c, nil
			}
			return nil, fmt.Errorf("supervisor exited before serving its socket: %v", c.err)
		default:
		}
		if time.Now().After(deadline) {
			c.Kill()
			return nil, fmt.Errorf("supervisor's control socket did not answer within %s (last: %v)", wait, err)
		}
		time.Sleep(2 * time.Millisecond) // poll interval, bounded by the deadline above
	}
}

// Call sends one request to the child's supervisor.
func (c *Child) Call(ctx context.Context, req Request) (*Response, error) {
	return Call(ctx, c.Dir, req)
}

// Do sends one request and turns a refusal into an error.
func (c *Child) Do(ctx context.Context, req Request) (*Response, error) {
	r, err := c.Call(ctx, req)
	if err != nil {
		return nil, err
	}
	if !r.OK {
		return r, fmt.Errorf("%s: %s", r.Code, r.Error)
	}
	return r, nil
}

// Wait waits up to timeout for the supervisor to exit.
func (c *Child) Wait(timeout time.Duration) error {
	select {
	case <-c.done:
		return c.err
	case <-time.After(timeout):
		return errors.New("supervisor did not exit in time")
	}
}

// Done is closed when the supervisor has exited.
func (c *Child) Done() <-chan struct{} { return c.done }

// Stop asks the supervisor to end the harness and waits for it to exit.
func (c *Child) Stop(ctx context.Context, timeout time.Duration) (*Receipt, error) {
	r, err := c.Do(ctx, Request{Op: OpStop})
	if werr := c.Wait(timeout); werr != nil && err == nil {
		var ee *exec.ExitError
		if !errors.As(werr, &ee) {
			err = werr
		}
	}
	if err != nil {
		return nil, err
	}
	return r.Receipt, nil
}

// Kill ends the supervisor with SIGKILL (its shim then kills the harness
// tree) and waits for it.
func (c *Child) Kill() {
	_ = c.Cmd.Process.Kill()
	<-c.done
}
