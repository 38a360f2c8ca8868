package microvm

import (
	"bytes"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/cavaliergopher/cpio"

	"stasis/internal/providers/microvm/agent"
	"stasis/internal/storage/atomicfile"
	"stasis/sandbox"
)

// GuestModules are the kernel modules the guest loads at boot, in an order
// that satisfies their dependencies (checked against each module's
// .modinfo when the image is built): virtio over memory-mapped I/O (the
// microvm machine's bus), the virtio network device that carries the
// agent's channel and the relay's way to the gateway, and for an image
// root the virtio block device, erofs (the block image's file system;
// the cloud kernel has ext4 built in) and overlayfs (its writable layer
// in RAM).
var GuestModules = []string{
	"drivers/virtio/virtio_ring",
	"drivers/virtio/virtio",
	"drivers/virtio/virtio_mmio",
	"net/core/failover",
	"drivers/net/net_failover",
	"drivers/net/virtio_net",
	"drivers/block/virtio_blk",
	"lib/libcrc32c",
	"fs/erofs/erofs",
	"fs/overlayfs/overlay",
}

// ImageRootDir is where, in a guest with an image, the image's root is
// (under an overlay whose upper layer is in RAM); the guest agent, and so
// everything the host runs there, is chrooted into it.
const ImageRootDir = "/newroot"

// Kernel is an unpacked Debian cloud kernel package: the kernel image and
// its module tree.
type Kernel struct {
	Dir     string // the unpacked package (holds boot/ and lib/modules/)
	Version string // 6.1.0-57-cloud-amd64, say
	Image   string // boot/vmlinuz-VERSION
	Modules string // lib/modules/VERSION/kernel
}

// FindKernel finds the newest cloud kernel unpacked under dir.
func FindKernel(dir string) (Kernel, error) {
	if dir == "" {
		return Kernel{}, errors.New("no kernel directory: set STASIS_MICROVM_KERNEL or run `make deps-microvm`")
	}
	imgs, _ := filepath.Glob(filepath.Join(dir, "boot", "vmlinuz-*-cloud-amd64"))
	if len(imgs) == 0 {
		return Kernel{}, fmt.Errorf("no boot/vmlinuz-*-cloud-amd64 under %s: unpack the Debian package linux-image-cloud-amd64's kernel there (`make deps-microvm` does)", dir)
	}
	sort.Strings(imgs)
	img := imgs[len(imgs)-1]
	v := strings.TrimPrefix(filepath.Base(img), "vmlinuz-")
	k := Kernel{Dir: dir, Version: v, Image: img, Modules: filepath.Join(dir, "lib", "modules", v, "kernel")}
	for _, m := range GuestModules {
		if _, err := os.Stat(filepath.Join(k.Modules, m+".ko")); err != nil {
			return Kernel{}, fmt.Errorf("kernel %s lacks module %s.ko (%v): unpack the whole package", v, m, err)
		}
	}
	return k, nil
}

// moduleDepends reads a module's depends= from its .modinfo section.
func moduleDepends(path string) ([]string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	s := f.Section(".modinfo")
	if s == nil {
		return nil, fmt.Errorf("%s: no .modinfo section", path)
	}
	b, err := s.Data()
	if err != nil {
		return nil, err
	}
	for _, kv := range bytes.Split(b, []byte{0}) {
		if v, ok := bytes.CutPrefix(kv, []byte("depends=")); ok {
			if len(v) == 0 {
				return nil, nil
			}
			return strings.Split(string(v), ","), nil
		}
	}
	return nil, nil
}

// checkModuleOrder fails unless every module's dependencies come before it
// in GuestModules.
func checkModuleOrder(k Kernel) error {
	seen := map[string]bool{}
	for _, m := range GuestModules {
		deps, err := moduleDepends(filepath.Join(k.Modules, m+".ko"))
		if err != nil {
			return err
		}
		for _, d := range deps {
			if !seen[d] {
				return fmt.Errorf("kernel %s: module %s needs %s, which the guest does not load before it", k.Version, filepath.Base(m), d)
			}
		}
		seen[filepath.Base(m)] = true
	}
	return nil
}

// The guest's network, QEMU's user-mode defaults: the guest is 10.0.2.15,
// and QEMU forwards GatewayAddr to the host's gateway.
const (
	guestIP     = "10.0.2.15"
	AgentPort   = agent.Port
	GatewayAddr = "10.0.2.100:80"
)

// rcScript is the guest's boot script, run by busybox init before the
// agent.
func rcScript() string {
	var b strings.Builder
	b.WriteString(`#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t cgroup2 cgroup2 /sys/fs/cgroup || echo 'stasis-guest: no cgroup v2'
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm && mount -t devpts devpts /dev/pts && mount -t tmpfs shm /dev/shm
mount -o remount,size=90% / 2>/dev/null
chmod 1777 /tmp
`)
	// The agent's user owns the work tree and its home; stasis's user
	// (root) owns everything else.
	fmt.Fprintf(&b, "mkdir -p %[1]s && chown %[2]d:%[2]d /work %[1]s && chmod 0755 /work && chmod 0700 %[1]s\n", AgentHome, sandbox.AgentUID)
	for _, m := range GuestModules {
		fmt.Fprintf(&b, "insmod /lib/modules/%s.ko || echo 'stasis-guest: insmod %s failed'\n", filepath.Base(m), filepath.Base(m))
	}
	// The guest finds its disks by serial (rootSerial, bindSerial), not
	// by the order they were probed in; the kernel command line says
	// where each bind disk goes (stasis.bind=I:PATH).
	b.WriteString(`disk() { for s in /sys/block/vd*; do [ "$(cat $s/serial 2>/dev/null)" = "$1" ] && { echo /dev/${s##*/}; return; }; done; }
binds=; for w in $(cat /proc/cmdline); do case "$w" in stasis.bind=*) binds="$binds ${w#stasis.bind=}";; esac; done
root=$(disk ` + rootSerial + `)
`)
	// With an image attached (read-only), its root becomes the sandbox's:
	// erofs (or ext4) under an overlay whose upper layer is a tmpfs, with
	// the guest's /proc, /sys and /dev, and stasis's binary at /stasis
	// read-only. The agent is started inside it (/etc/agent). Bind disks
	// are mounted read-only at their paths, in the image's root or, with
	// none, in the initramfs (their mount points under /stasis are made
	// before /stasis turns read-only).
	fmt.Fprintf(&b, `r=
if [ -n "$root" ]; then
  r=%[1]s
  mkdir -p /image /rw $r
  mount -t erofs -o ro $root /image 2>/dev/null || mount -t ext4 -o ro,noload $root /image || echo 'stasis-guest: the image does not mount'
  mount -t tmpfs -o mode=0755,size=90%% rw /rw && mkdir -p /rw/upper /rw/work
  mount -t overlay overlay -o lowerdir=/image,upperdir=/rw/upper,workdir=/rw/work $r || echo 'stasis-guest: no overlay on the image'
  for d in proc sys dev; do mkdir -p $r/$d && mount --rbind /$d $r/$d; done
  mkdir -p $r/tmp $r/work $r/stasis $r%[2]s
  chmod 1777 $r/tmp
fi
for bd in $binds; do p=${bd#*:}; case "$p" in /stasis/*) mkdir -p "$p";; *) mkdir -p "$r$p";; esac; done
if [ -n "$r" ]; then
  mount --bind /stasis $r/stasis && mount -o remount,bind,ro $r/stasis
  chown %[3]d:%[3]d $r/work $r%[2]s && chmod 0755 $r/work && chmod 0700 $r%[2]s
  touch /run/stasis-image-root
fi
for bd in $binds; do
  n=${bd%%%%:*}; p=${bd#*:}; d=$(disk stasis-bind$n)
  mount -t erofs -o ro "$d" "$r$p" || echo "stasis-guest: the read-only bind at $p does not mount"
done
`, ImageRootDir, AgentHome, sandbox.AgentUID)
	fmt.Fprintf(&b, `ip link set lo up
ip link set eth0 up
ip addr add %s/24 dev eth0
ip route add default via 10.0.2.2
echo 'stasis-guest: booted'
`, guestIP)
	return b.String()
}

// agentScript starts the guest agent: inside the image's root when the
// guest has one, else in the initramfs.
func agentScript() string {
	cmd := fmt.Sprintf("/stasis/bin/stasis microvm agent --listen :%[1]d --agent-uid %[2]d --agent-gid %[2]d --agent-home %[3]s --host-only", agent.Port, sandbox.AgentUID, AgentHome)
	return fmt.Sprintf(`#!/bin/sh
if [ -e /run/stasis-image-root ]; then
  exec chroot %s %s
fi
exec %s
`, ImageRootDir, cmd, cmd)
}

// AgentHome is the home directory of the guest's agent user.
const AgentHome = "/home/agent"

// inittab runs the boot script, then the agent, which runs the host's
// commands as the agent's user (uid and gid sandbox.AgentUID) unless asked
// for stasis's, and takes connections from the host only.
var inittab = `::sysinit:/etc/rc
::respawn:/etc/agent
`

// BuildInitramfs writes the guest's initramfs (an uncompressed newc cpio:
// the kernel unpacks it faster than a compressed one under TCG) to w:
// busybox as /bin/busybox with init and /bin/sh, the boot script, the
// kernel modules, and the static stasis binary at /stasis/bin/stasis.
func BuildInitramfs(w io.Writer, k Kernel, busybox, stasisBin string) error {
	if err := checkModuleOrder(k); err != nil {
		return err
	}
	if err := checkStatic(busybox); err != nil {
		return err
	}
	if err := checkStatic(stasisBin); err != nil {
		return err
	}
	cw := cpio.NewWriter(w)
	now := time.Unix(0, 0)
	dir := func(name string, mode cpio.FileMode) error {
		return cw.WriteHeader(&cpio.Header{Name: name, Mode: cpio.TypeDir | mode, ModTime: now})
	}
	file := func(name string, mode cpio.FileMode, data []byte) error {
		if err := cw.WriteHeader(&cpio.Header{Name: name, Mode: cpio.TypeReg | mode, Size: int64(len(data)), ModTime: now}); err != nil {
			return err
		}
		_, err := cw.Write(data)
		return err
	}
	link := func(name, target string) error {
		// newc keeps a symlink's target as its data.
		if err := cw.WriteHeader(&cpio.Header{Name: name, Mode: cpio.TypeSymlink | 0o777, Size: int64(len(target)), ModTime: now}); err != nil {
			return err
		}
		_, err := cw.Write([]byte(target))
		return err
	}
	copyFile := func(name, src string) error {
		f, err := os.Open(src)
		if err != nil {
			return err
		}
		defer f.Close()
		fi, err := f.Stat()
		if err != nil {
			return err
		}
		if err := cw.WriteHeader(&cpio.Header{Name: name, Mode: cpio.TypeReg | 0o755, Size: fi.Size(), ModTime: now}); err != nil {
			return err
		}
		_, err = io.Copy(cw, f)
		return err
	}
	for _, d := range []string{"bin", "sbin", "usr", "usr/bin", "usr/sbin", "etc", "proc", "sys", "dev", "run", "root", "work", "lib", "lib/modules", "stasis", "stasis/bin", "var", "var/log"} {
		if err := dir(d, 0o755); err != nil {
			return err
		}
	}
	if err := dir("tmp", 0o1777); err != nil {
		return err
	}
	steps := []func() error{
		func() error { return copyFile("bin/busybox", busybox) },
		func() error { return link("init", "bin/busybox") },
		func() error { return link("sbin/init", "../bin/busybox") },
		func() error { return link("bin/sh", "busybox") },
		func() error { return file("etc/rc", 0o755, []byte(rcScript())) },
		func() error { return file("etc/inittab", 0o644, []byte(inittab)) },
		func() error { return file("etc/agent", 0o755, []byte(agentScript())) },
		func() error {
			return file("etc/passwd", 0o644, []byte(fmt.Sprintf("root:x:0:0:root:/root:/bin/sh\nagent:x:%[1]d:%[1]d:agent:%[2]s:/bin/sh\n", sandbox.AgentUID, AgentHome)))
		},
		func() error {
			return file("etc/group", 0o644, []byte(fmt.Sprintf("root:x:0:\nagent:x:%d:\n", sandbox.AgentUID)))
		},
		func() error { return file("etc/hosts", 0o644, []byte("127.0.0.1 localhost\n")) },
		func() error { return copyFile("stasis/bin/stasis", stasisBin) },
	}
	for _, m := range GuestModules {
		m := m
		steps = append(steps, func() error {
			return copyFile("lib/modules/"+filepath.Base(m)+".ko", filepath.Join(k.Modules, m+".ko"))
		})
	}
	for _, s := range steps {
		if err := s(); err != nil {
			return fmt.Errorf("initramfs: %w", err)
		}
	}
	// Every applet, as a link in /bin (busybox --install at boot would do
	// it too, but a link made at build time costs nothing at boot).
	out, err := exec.Command(busybox, "--list").Output()
	if err != nil {
		return fmt.Errorf("initramfs: %s --list: %w", busybox, err)
	}
	for _, a := range strings.Fields(string(out)) {
		switch a {
		case "busybox", "sh", "init", "linuxrc":
			continue
		}
		if strings.ContainsRune(a, '/') {
			continue
		}
		if err := link("bin/"+a, "busybox"); err != nil {
			return err
		}
	}
	return cw.Close()
}

// checkStatic fails unless path is a statically linked ELF executable
// (the guest has no dynamic loader or libc).
func checkStatic(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("%s is dynamically linked; the guest needs a static binary (stasis: build with CGO_ENABLED=0, as `make build` does; busybox: `apt-get install busybox-static`)", path)
		}
	}
	return nil
}

// IsStatic says whether path is a static executable.
func IsStatic(path string) bool { return checkStatic(path) == nil }

// Initramfs returns the path of the guest initramfs for these inputs,
// building it into cacheDir when it is not there yet. The file's name is a
// hash of the inputs' contents, so a rebuilt stasis gets a new image.
func Initramfs(cacheDir string, k Kernel, busybox, stasisBin string) (string, error) {
	h := sha256.New()
	for _, p := range []string{busybox, stasisBin, k.Image} {
		f, err := os.Open(p)
		if err != nil {
			return "", err
		}
		_, err = io.Copy(h, f)
		f.Close()
		if err != nil {
			return "", err
		}
	}
	fmt.Fprintf(h, "%s\n%s\n%s\n%s\n", k.Version, rcScript(), inittab, agentScript())
	path := filepath.Join(cacheDir, "initramfs-"+hex.EncodeToString(h.Sum(nil))[:16]+".cpio")
	if _, err := os.Stat(path); err == nil {
		return path, nil
	}
	if err := os.MkdirAll(cacheDir, 0o700); err != nil {
		return "", err
	}
	var buf bytes.Buffer
	if err := BuildInitramfs(&buf, k, busybox, stasisBin); err != nil {
		return "", err
	}
	if err := atomicfile.Write(path, buf.Bytes(), 0o600); err != nil {
		return "", err
	}
	return path, nil
}

// CanRun says whether a guest can run a task in language on image (the
// task's or the run's; "" for none): on an image, whatever the image has;
// on the initramfs alone, busybox and stasis, no Python, Node.js or Go,
// so shell tasks only.
func CanRun(language, image string) bool {
	return language == "shell" || image != ""
}
