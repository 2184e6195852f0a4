module github.com/rbd-nbd-go/rbd-nbd-go

go 1.26

require (
	github.com/spf13/cobra v1.8.1
	golang.org/x/sys v0.47.0
)

require (
	github.com/ceph/go-ceph v0.41.0 // indirect
	github.com/inconshreveable/mousetrap v1.1.0 // indirect
	github.com/spf13/pflag v1.0.5 // indirect
)
