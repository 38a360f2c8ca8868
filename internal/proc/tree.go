package proc

import (
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

var errSRCH = syscall.ESRCH

// All reads the stat of every process visible in /proc. Processes that vanish
// while being read are skipped.
func All() (map[int]Stat, error) {
	d, err := os.Open(Root)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	names, err := d.Readdirnames(-1)
	if err != nil {
		return nil, err
	}
	out := make(map[int]Stat, len(names))
	for _, n := range names {
		if n[0] < '0' || n[0] > '9' {
			continue
		}
		pid, err := strconv.Atoi(n)
		if err != nil {
			continue
		}
		s, err := ReadStat(pid)
		if err != nil {
			continue // gone, or unreadable: not ours to judge
		}
		out[pid] = s
	}
	return out, nil
}

// Descendants returns every process below root (children, their children,
// and so on, whatever session or process group they moved to), in
// breadth-first order. Root itself is not included. The links are read one
// process at a time; a caller that must catch processes forked meanwhile
// calls it again.
//
// It follows /proc/PID/task/TID/children, reading only the tree itself; on
// a kernel without those files it scans every process instead.
func Descendants(root int) ([]Stat, error) {
	if !childrenFiles() {
		all, err := All()
		if err != nil {
			return nil, err
		}
		return DescendantsIn(all, root), nil
	}
	return walk(root, Children, func(parent, pid int) (Stat, bool) {
		s, err := ReadStat(pid)
		// Gone, or re-parented meanwhile (then found under its new parent).
		return s, err == nil && s.PPID == parent
	}), nil
}

var (
	childrenOnce sync.Once
	childrenOK   bool
)

// childrenFiles reports whether the kernel has /proc/PID/task/TID/children
// (CONFIG_PROC_CHILDREN).
func childrenFiles() bool {
	childrenOnce.Do(func() {
		_, err := os.Stat(fmt.Sprintf("%s/%d/task/%d/children", Root, os.Getpid(), os.Getpid()))
		childrenOK = err == nil
	})
	return childrenOK
}

// Children lists the PIDs of pid's children, from every thread's children
// file. A process that is gone has none.
func Children(pid int) []int {
	dir := fmt.Sprintf("%s/%d/task", Root, pid)
	d, err := os.Open(dir)
	if err != nil {
		return nil
	}
	tids, err := d.Readdirnames(-1)
	d.Close()
	if err != nil {
		return nil
	}
	var out []int
	buf := make([]byte, 4096)
	for _, tid := range tids {
		f, err := os.Open(dir + "/" + tid + "/children")
		if err != nil {
			continue
		}
		var b []byte
		for {
			n, err := f.Read(buf)
			b = append(b, buf[:n]...)
			if err != nil || n == 0 {
				break
			}
		}
		f.Close()
		for _, w := range strings.Fields(string(b)) {
			if c, err := strconv.Atoi(w); err == nil {
				out = append(out, c)
			}
		}
	}
	return out
}

// DescendantsIn is Descendants over an already-read process table.
func DescendantsIn(all map[int]Stat, root int) []Stat {
	children := make(map[int][]int, len(all))
	for pid, s := range all {
		children[s.PPID] = append(children[s.PPID], pid)
	}
	for _, c := range children {
		sort.Ints(c)
	}
	return walk(root, func(p int) []int { return children[p] }, func(_, pid int) (Stat, bool) { return all[pid], true })
}

// walk visits the tree below root breadth first; stat reads a child and says
// whether it still belongs under parent.
func walk(root int, children func(int) []int, stat func(parent, pid int) (Stat, bool)) []Stat {
	var out []Stat
	queue := []int{root}
	seen := map[int]bool{root: true}
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		for _, c := range children(p) {
			if seen[c] {
				continue
			}
			s, ok := stat(p, c)
			if !ok {
				continue
			}
			seen[c] = true
			out = append(out, s)
			queue = append(queue, c)
		}
	}
	return out
}

// TaskStates returns the scheduler state of every thread of process pid
// (from /proc/PID/task/*/stat). A process whose threads cannot be listed
// gives an error wrapping ErrNoProcess.
func TaskStates(pid int) ([]byte, error) {
	dir := fmt.Sprintf("%s/%d/task", Root, pid)
	d, err := os.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", dir, ErrNoProcess)
	}
	defer d.Close()
	names, err := d.Readdirnames(-1)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", dir, ErrNoProcess)
	}
	states := make([]byte, 0, len(names))
	for _, n := range names {
		s, err := readStatFile(dir + "/" + n + "/stat")
		if err != nil {
			continue // the thread exited meanwhile
		}
		states = append(states, s.State)
	}
	return states, nil
}

// Stopped reports whether a scheduler state means the task runs no code and
// will run none until continued or reaped: stopped by a signal (T), stopped
// for tracing (t), or dead (Z, X).
func Stopped(state byte) bool {
	switch state {
	case 'T', 't', 'Z', 'X':
		return true
	}
	return false
}
