#!/usr/bin/env bash
# The root filesystem of the GUI template for backend="vm": Debian with Xorg (fbdev and modesetting
# drivers, evdev input), the twm window manager, xterm and the Dillo browser (FLTK: it renders a local
# page in seconds under TCG, where a WebKit or Chromium browser takes minutes to start), from debootstrap,
# cached as a directory keyed on suite, mirror and package list. The VM backend boots it with Debian's generic kernel
# (linux-image-amd64: bochs DRM, fbdev), which it fetches itself.
#   bash compose/gui-rootfs.sh     print the rootfs directory, building it when missing
set -euo pipefail
suite="${DSEC_GUI_SUITE:-bookworm}"
mirror="${DSEC_GUI_MIRROR:-http://deb.debian.org/debian}"
cache="${DSEC_CACHE_DIR:-/var/cache/dsec}"
pkgs="xserver-xorg-core,xserver-xorg-video-fbdev,xserver-xorg-input-evdev,xinit,x11-xkb-utils,xkb-data,twm,xterm,xfonts-base,procps,dillo,fonts-dejavu-core"
key="$(printf '%s\n%s\n%s\n%s\n' "$suite" "$mirror" "$pkgs" "$(sha256sum < "$0")" | sha256sum | cut -c1-12)"  # (and this script)
root="$cache/dsec-gui-$suite-$key"

if [ ! -f "$root/.dsec-gui-done" ]; then
  mkdir -p "$cache"
  tmp="$(mktemp -d "$cache/gui.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  echo "dsec: debootstrap $suite with Xorg into $tmp (cached as $root)" >&2
  debootstrap --variant=minbase --include="$pkgs" "$suite" "$tmp" "$mirror" >&2
  rm -rf "$tmp"/var/cache/apt/archives/*.deb "$tmp"/var/lib/apt/lists/* "$tmp"/var/log/*
  # No udev in the guest: the X server is told its devices (the kernel's DRM/fbdev and evdev nodes).
  mkdir -p "$tmp/etc/X11" "$tmp/usr/local/bin"
  cat > "$tmp/etc/X11/dsec.conf" <<'CONF'
Section "Module"
    Disable "glx"
EndSection
Section "ServerFlags"
    Option "AutoAddDevices" "false"
    Option "AutoEnableDevices" "false"
    Option "DontVTSwitch" "true"
EndSection
Section "Device"
    Identifier "fb"
    Driver "modesetting"
    Option "kmsdev" "/dev/dri/card0"
    Option "AccelMethod" "none"
EndSection
Section "InputDevice"
    Identifier "kbd"
    Driver "evdev"
    Option "Device" "/dev/input/by-dsec/keyboard"
EndSection
Section "InputDevice"
    Identifier "tablet"
    Driver "evdev"
    Option "Device" "/dev/input/by-dsec/tablet"
EndSection
Section "ServerLayout"
    Identifier "dsec"
    Screen "screen"
    InputDevice "kbd" "CoreKeyboard"
    InputDevice "tablet" "CorePointer"
EndSection
Section "Screen"
    Identifier "screen"
    Device "fb"
EndSection
CONF
  cat > "$tmp/usr/local/bin/dsec-desktop" <<'SH'
#!/bin/sh
# The desktop on the VM's display: Xorg on vt1, twm, one xterm. Input nodes are found by name.
mkdir -p /dev/input/by-dsec
for e in /sys/class/input/event*; do
  case "$(cat "$e/device/name")" in
    *Tablet*) ln -sf "/dev/input/${e##*/}" /dev/input/by-dsec/tablet ;;
    *AT*keyboard*|*Keyboard*) ln -sf "/dev/input/${e##*/}" /dev/input/by-dsec/keyboard ;;
  esac
done
Xorg :0 vt1 -config /etc/X11/dsec.conf -nolisten tcp -noreset >/tmp/Xorg.log 2>&1 &
for i in $(seq 1 600); do [ -e /tmp/.X11-unix/X0 ] && break; sleep 0.1; done
export DISPLAY=:0 HOME=/root
twm >/tmp/twm.log 2>&1 &
# /run/dsec-desktop: the terminal's shell runs, so X is up and its input devices are enabled
exec xterm -geometry 80x24+20+20 -e sh -c 'touch /run/dsec-desktop; exec bash' >/tmp/xterm.log 2>&1
SH
  chmod 755 "$tmp/usr/local/bin/dsec-desktop"
  touch "$tmp/.dsec-gui-done"
  rm -rf "$root"
  mv "$tmp" "$root"
  trap - EXIT
fi
echo "$root"
