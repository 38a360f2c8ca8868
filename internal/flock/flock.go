// Package flock owns stasis's advisory file locks (flock(2)): the blob
// stores' locks, a sandbox's snapshot lock, and the lock under which a
// blob store rewrites its packs' dead lists.
package flock

import (
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// Lock takes an advisory lock on path (made if missing), shared or
// exclusive, waiting for it, until the returned function is called.
func Lock(path string, exclusive bool) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	how := unix.LOCK_SH
	if exclusive {
		how = unix.LOCK_EX
	}
	for {
		err = unix.Flock(int(f.Fd()), how)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, &os.PathError{Op: "flock", Path: path, Err: err}
	}
	return func() { _ = unix.Flock(int(f.Fd()), unix.LOCK_UN); f.Close() }, nil
}

// ErrHeld is TryLock's answer when another holder has the lock.
var ErrHeld = errors.New("the lock is held")

// TryLock takes an exclusive lock on path (made if missing) without
// waiting; ErrHeld when someone else holds it.
func TryLock(path string) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if errors.Is(err, unix.EWOULDBLOCK) {
		f.Close()
		return nil, ErrHeld
	}
	if err != nil {
		f.Close()
		return nil, &os.PathError{Op: "flock", Path: path, Err: err}
	}
	return func() { _ = unix.Flock(int(f.Fd()), unix.LOCK_UN); f.Close() }, nil
}
