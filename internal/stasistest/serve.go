package stasistest

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Serve is a `stasis serve` child process: this test binary acting as
// stasis (Exe, Env), its standard error in a log file, its address the
// line it printed first.
type Serve struct {
	// Addr is the address it serves the API on (host:port).
	Addr string
	// Log is the file its standard error goes to.
	Log  string
	cmd  *exec.Cmd
	done chan struct{}
}

// ServeOptions are how StartServe starts a server.
type ServeOptions struct {
	// Env is added to the environment (Exe's and Env's).
	Env []string
	// Log is the file its standard error is appended to (default: a new
	// file under the system's temporary directory, removed by the test's
	// cleanup when started by StartServeT).
	Log string
	// Wait bounds the start, until the address is printed (default 60s).
	// A server that has not printed it by then gets SIGQUIT, which has
	// the Go runtime write every goroutine's stack to its log, and the
	// start fails with the log.
	Wait time.Duration
}

// StartServe starts `stasis serve ARGS...`, with --listen 127.0.0.1:0
// unless args give --listen, and returns once it has printed its address.
// The caller ends it (Kill or Stop).
func StartServe(o ServeOptions, args ...string) (*Serve, error) {
	if o.Wait == 0 {
		o.Wait = time.Minute
	}
	var logf *os.File
	var err error
	if o.Log == "" {
		logf, err = os.CreateTemp("", "stasis-serve-*.log")
	} else {
		logf, err = os.OpenFile(o.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	}
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	argv := append([]string{"serve"}, args...)
	if !slices.ContainsFunc(args, func(a string) bool { return a == "--listen" || strings.HasPrefix(a, "--listen=") }) {
		argv = append(argv, "--listen", "127.0.0.1:0")
	}
	s := &Serve{Log: logf.Name(), cmd: exec.Command(Exe(), argv...), done: make(chan struct{})}
	s.cmd.Env = append(append(os.Environ(), Env...), o.Env...)
	s.cmd.Stderr = logf
	out, err := s.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := s.cmd.Start(); err != nil {
		return nil, err
	}
	line := make(chan string, 1)
	go func() {
		l, _ := bufio.NewReader(out).ReadString('\n')
		line <- strings.TrimSpace(l)
		_, _ = io.Copy(io.Discard, out)
		_ = s.cmd.Wait()
		close(s.done)
	}()
	select {
	case s.Addr = <-line:
		if s.Addr == "" {
			<-s.done
			return s, fmt.Errorf("stasis serve printed no address (exit %d); its log:\n%s", s.ExitCode(), s.LogTail(40))
		}
		return s, nil
	case <-time.After(o.Wait):
		_ = s.cmd.Process.Signal(syscall.SIGQUIT)
		select {
		case <-s.done:
		case <-time.After(10 * time.Second):
			_ = s.cmd.Process.Kill()
			<-s.done
		}
		b, _ := os.ReadFile(s.Log)
		return s, fmt.Errorf("stasis serve printed no address within %s; its log, with its goroutines at SIGQUIT:\n%s", o.Wait, b)
	}
}

// StartServeT is StartServe for a test: a failure to start fails it, and
// its cleanup kills the server if it still runs (and removes the log
// StartServe made).
func StartServeT(t testing.TB, o ServeOptions, args ...string) *Serve {
	t.Helper()
	temp := o.Log == ""
	s, err := StartServe(o, args...)
	if s != nil {
		t.Cleanup(func() {
			s.Kill()
			if temp {
				_ = os.Remove(s.Log)
			}
		})
	}
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// Done is closed once the server has exited.
func (s *Serve) Done() <-chan struct{} { return s.done }

// Pid is the server's process id.
func (s *Serve) Pid() int { return s.cmd.Process.Pid }

// ExitCode is the server's exit status once Done (-1 when a signal
// ended it).
func (s *Serve) ExitCode() int { return s.cmd.ProcessState.ExitCode() }

// Signal sends sig to the server.
func (s *Serve) Signal(sig os.Signal) error { return s.cmd.Process.Signal(sig) }

// Kill ends the server with SIGKILL, as a crash would, and waits until
// it has exited; a server already gone is left alone.
func (s *Serve) Kill() {
	select {
	case <-s.done:
	default:
		_ = s.cmd.Process.Kill()
		<-s.done
	}
}

// Stop ends the server with SIGTERM and waits until it has exited, at
// most wait (then it kills it). It fails unless the server exited 0.
func (s *Serve) Stop(wait time.Duration) error {
	if err := s.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return err
	}
	select {
	case <-s.done:
	case <-time.After(wait):
		s.Kill()
		return fmt.Errorf("stasis serve still ran %s after SIGTERM; its log:\n%s", wait, s.LogTail(40))
	}
	if code := s.ExitCode(); code != 0 {
		return fmt.Errorf("stasis serve exited %d after SIGTERM; its log:\n%s", code, s.LogTail(40))
	}
	return nil
}

// LogTail is the last n lines of the server's log.
func (s *Serve) LogTail(n int) string {
	b, _ := os.ReadFile(s.Log)
	ls := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(ls) > n {
		ls = ls[len(ls)-n:]
	}
	return strings.Join(ls, "\n")
}
