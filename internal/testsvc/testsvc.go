// Package testsvc owns the server processes a test binary shares among its
// tests (a PostgreSQL server, an S3 server): started once per test process
// as its children, each in its own process group with a parent-death
// signal, so that a test binary that dies takes them along; stopped, and
// their directories removed, after the tests. The checks that a test left
// no process behind look past them (Owns).
package testsvc

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"testing"
	"time"

	"stasis/internal/proc"
)

// Service is one shared server process.
type Service struct {
	Name string
	cmd  *exec.Cmd
	dir  string
	stop syscall.Signal
	done chan struct{}
	err  error // the process's exit, once done is closed
}

var (
	mu       sync.Mutex
	services []*Service
)

// Start starts cmd as a shared service: in a process group of its own, sent
// SIGKILL if the test process dies, stopped by stopSignal (then SIGKILL) by
// StopAll, which then removes dir (may be ""). cmd.SysProcAttr, if set,
// keeps its credentials.
func Start(name string, cmd *exec.Cmd, dir string, stopSignal syscall.Signal) (*Service, error) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setpgid = true
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	s := &Service{Name: name, cmd: cmd, dir: dir, stop: stopSignal, done: make(chan struct{})}
	go func() {
		s.err = cmd.Wait()
		close(s.done)
	}()
	mu.Lock()
	services = append(services, s)
	mu.Unlock()
	return s, nil
}

// Done is closed when the service's process has exited.
func (s *Service) Done() <-chan struct{} { return s.done }

// Pid is the service's process id.
func (s *Service) Pid() int { return s.cmd.Process.Pid }

// Exited reports whether the service's process has ended, and how.
func (s *Service) Exited() (bool, error) {
	select {
	case <-s.done:
		return true, s.err
	default:
		return false, nil
	}
}

// Stop ends the service: stopSignal to its process group, SIGKILL after
// grace, and waits for the process.
func (s *Service) Stop(grace time.Duration) error {
	pgid := s.cmd.Process.Pid
	_ = syscall.Kill(-pgid, s.stop)
	select {
	case <-s.done:
	case <-time.After(grace):
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		<-s.done
	}
	// What the service started in its group (a PostgreSQL backend, say)
	// ends with it; whatever is left gets SIGKILL.
	_ = syscall.Kill(-pgid, syscall.SIGKILL)
	if s.dir != "" {
		if err := os.RemoveAll(s.dir); err != nil {
			return fmt.Errorf("remove %s's directory: %w", s.Name, err)
		}
	}
	return nil
}

// StopAll stops every service started, newest first.
func StopAll() error {
	mu.Lock()
	ss := services
	services = nil
	mu.Unlock()
	var errs []error
	for i := len(ss) - 1; i >= 0; i-- {
		errs = append(errs, ss[i].Stop(30*time.Second))
	}
	return errors.Join(errs...)
}

// Owns reports the processes among all that belong to a running service:
// its process and every descendant.
func Owns(all map[int]proc.Stat) map[int]bool {
	mu.Lock()
	defer mu.Unlock()
	owned := map[int]bool{}
	for _, s := range services {
		pid := s.cmd.Process.Pid
		owned[pid] = true
		for _, d := range proc.DescendantsIn(all, pid) {
			owned[d.PID] = true
		}
	}
	return owned
}

// Main runs the tests, then stops every service: the TestMain of a package
// whose tests start services and that has no other TestMain.
func Main(m *testing.M) {
	code := m.Run()
	if err := StopAll(); err != nil {
		fmt.Fprintln(os.Stderr, "FAIL: stopping the test services:", err)
		code = 1
	}
	os.Exit(code)
}
