// Package proc reads what stasis needs from Linux's /proc: a process's
// identity (PID plus start time), its scheduler state, its parent, the whole
// tree of processes below a given one, and the machine's uptime.
//
// It owns parsing only; it sends no signals and changes nothing.
package proc

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Root is the mount point of procfs. Tests never change it; it exists so the
// parsing can be exercised on copied files.
const Root = "/proc"

// Identity recognises one launch of a process: its PID and its start time in
// clock ticks since boot (field 22 of /proc/PID/stat). A PID alone can be
// reused; the pair cannot, within one boot.
type Identity struct {
	PID       int    `json:"pid"`
	StartTime uint64 `json:"start_time"`
}

func (id Identity) String() string { return fmt.Sprintf("%d@%d", id.PID, id.StartTime) }

// Stat is the part of /proc/PID/stat that stasis uses.
type Stat struct {
	PID       int
	Comm      string // the command name, without the surrounding parentheses
	State     byte   // R, S, D, T, t, Z, X, I, ...
	PPID      int
	PGID      int
	SID       int
	StartTime uint64 // field 22, clock ticks since boot
}

// ErrNoProcess reports that the process does not exist (or vanished while
// being read).
var ErrNoProcess = errors.New("no such process")

// ParseStat parses the contents of a /proc/PID/stat (or task/TID/stat) file.
//
// The command name (field 2) is enclosed in parentheses and may itself hold
// spaces, parentheses and any other byte except NUL, so the name ends at the
// last ')' in the line, never the first.
func ParseStat(b []byte) (Stat, error) {
	var s Stat
	open := bytes.IndexByte(b, '(')
	closing := bytes.LastIndexByte(b, ')')
	if open < 0 || closing < open {
		return s, fmt.Errorf("proc stat: no (comm) field in %q", truncate(b))
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b[:open])))
	if err != nil || pid <= 0 {
		return s, fmt.Errorf("proc stat: bad pid field %q", truncate(b[:open]))
	}
	s.PID = pid
	s.Comm = string(b[open+1 : closing])
	rest := strings.Fields(string(b[closing+1:]))
	// rest[0] is field 3 (state); field k is rest[k-3].
	if len(rest) < 20 {
		return s, fmt.Errorf("proc stat: %d fields after comm, want at least 20", len(rest))
	}
	if len(rest[0]) != 1 {
		return s, fmt.Errorf("proc stat: bad state field %q", rest[0])
	}
	s.State = rest[0][0]
	ints := []*int{&s.PPID, &s.PGID, &s.SID}
	for i, p := range ints {
		v, err := strconv.Atoi(rest[1+i])
		if err != nil {
			return s, fmt.Errorf("proc stat: field %d: %w", 4+i, err)
		}
		*p = v
	}
	st, err := strconv.ParseUint(rest[19], 10, 64)
	if err != nil {
		return s, fmt.Errorf("proc stat: start time (field 22): %w", err)
	}
	s.StartTime = st
	return s, nil
}

func truncate(b []byte) string {
	if len(b) > 80 {
		return string(b[:80]) + "..."
	}
	return string(b)
}

// ReadStat reads /proc/PID/stat. A process that does not exist gives an error
// wrapping ErrNoProcess.
func ReadStat(pid int) (Stat, error) {
	return readStatFile(fmt.Sprintf("%s/%d/stat", Root, pid))
}

func readStatFile(path string) (Stat, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, errSRCH) {
			return Stat{}, fmt.Errorf("%s: %w", path, ErrNoProcess)
		}
		return Stat{}, err
	}
	return ParseStat(b)
}

// Self returns the identity of the calling process.
func Self() (Identity, error) { return IdentityOf(os.Getpid()) }

// IdentityOf returns the identity of process pid.
func IdentityOf(pid int) (Identity, error) {
	s, err := ReadStat(pid)
	if err != nil {
		return Identity{}, err
	}
	return Identity{PID: s.PID, StartTime: s.StartTime}, nil
}

// Alive reports whether the process with this identity still exists (the
// PID exists and has the same start time) and is not a zombie.
func Alive(id Identity) bool {
	s, err := ReadStat(id.PID)
	if err != nil {
		return false
	}
	return s.StartTime == id.StartTime && s.State != 'Z' && s.State != 'X'
}

// ParseUptime parses /proc/uptime and returns the first field: seconds since
// boot.
func ParseUptime(b []byte) (float64, error) {
	f := strings.Fields(string(b))
	if len(f) < 1 {
		return 0, fmt.Errorf("proc uptime: empty")
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil || v < 0 {
		return 0, fmt.Errorf("proc uptime: bad value %q", f[0])
	}
	return v, nil
}

// Uptime returns the seconds since boot: CLOCK_BOOTTIME, the clock
// /proc/uptime shows, read to the nanosecond (/proc/uptime rounds it to
// 10 ms, which a continuous clock after a restore would inherit).
func Uptime() (float64, error) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		return 0, fmt.Errorf("clock_gettime(CLOCK_BOOTTIME): %w", err)
	}
	return float64(ts.Sec) + float64(ts.Nsec)/1e9, nil
}
