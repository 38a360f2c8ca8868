package local

import (
	"context"
	"maps"
	"path"

	"stasis/sandbox"
)

func init() {
	sandbox.Register(Name, sandbox.Driver{
		GatewayURL: "unix://" + path.Join(GatewayDirInSandbox, GatewaySocketName),
		Blobs:      true,
		NoFreeze:   "local sandboxes mount no cgroup file system for the supervisor (bubblewrap gives none, and the sandbox's control group is the host's to manage)",
		Open: func(_ context.Context, c sandbox.Config) (sandbox.Provider, error) {
			ro := maps.Clone(c.ReadOnlyBinds)
			if c.Binary != "" {
				if ro == nil {
					ro = map[string]string{}
				}
				ro[c.Binary] = sandbox.BinaryPath
			}
			p, err := New(Options{
				Home: c.Home, Exe: c.Exe, ExeEnv: c.ExeEnv, SandboxBinary: c.SandboxBinary,
				GatewayDir: c.GatewayDir, Gateway: c.Gateway, ReadOnlyBinds: ro,
				Hide: c.Hide, Limits: c.Limits, Blobs: c.Blobs, SnapshotHook: c.SnapshotHook,
			})
			if err != nil {
				return nil, err
			}
			return p, nil
		},
	})
}
