#!/usr/bin/env bash
# Builds the small test guests that a QEMU VM boots, from Debian packages only, into OUTDIR (the first argument, else
# $KUBEVBMC_GUESTS, else ~/.cache/kubevbmc/guests). Each guest runs Debian's kernel with a busybox initramfs that
# prints, on the serial line (ttyS0) and on the screen (tty0):
#   KUBEVBMC-GUEST: booted from <iso|disk|signed-iso|network>
#   KUBEVBMC-GUEST: firmware <bios|uefi> secureboot <on|off>
# then serves `kubevbmc-guest login: ` on ttyS0 and tty1 (root / guest, prompt `guest# `) and powers off on the ACPI
# power button. The file names below are a contract the simulator and the tests rely on:
#   guest.iso           BIOS + UEFI hybrid ISO (grub-mkrescue, unsigned GRUB), medium=iso
#   disk.img            the same as a raw hard-disk image, medium=disk
#   blank.iso           a valid ISO 9660 image with a file in it, not bootable
#   signed.iso          UEFI-only ISO with Debian's signed shim, GRUB and kernel (boots with secure boot on),
#                       medium=signed-iso
#   netboot/            the TFTP root for QEMU's user network (medium=network):
#     boot.ipxe         the bootfile for iPXE (SeaBIOS' PXE ROM; also iPXE's UEFI driver)
#     bootx64.efi       the bootfile for UEFI PXE (a GRUB netboot image that reads grub/grub.cfg over TFTP)
#     grub/grub.cfg, vmlinuz, initrd.img
# The guest's own contents (kernel, busybox, shim, signed GRUB) are fetched with `apt-get download` into
# OUTDIR/.debs and unpacked with dpkg-deb; nothing of theirs is installed on the host. The build tools are installed
# with apt-get when one is missing. A stamp (OUTDIR/.stamp) holds the hash of this script (everything the guests are
# made of is in it, but the packages) and the packages' versions: when the hash matches and every output is there, the
# script returns at once, without asking apt (remove the stamp to rebuild with newer packages). Concurrent runs are
# serialized by a lock on OUTDIR.lock, and every output is built in a temporary directory inside OUTDIR and renamed
# into place.
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin  # mkfs.vfat, for a user whose PATH lacks them

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
repo_dir=$(dirname "$script_dir")
outdir=$(realpath -m "${1:-${KUBEVBMC_GUESTS:-${HOME:?}/.cache/kubevbmc/guests}}")
case "$outdir/" in
  "$repo_dir/"*) echo "build-guests: refusing to write into the repository ($outdir)" >&2; exit 2 ;;
esac

# --- the host's tools: command or file -> the Debian package that provides it --------------------------------------
declare -A package_of=(
  [grub-mkrescue]=grub-common
  [grub-mkimage]=grub-common
  [/usr/lib/grub/i386-pc/boot_hybrid.img]=grub-pc-bin
  [/usr/lib/grub/x86_64-efi/linux.mod]=grub-efi-amd64-bin
  [xorriso]=xorriso
  [mcopy]=mtools
  [mkfs.vfat]=dosfstools
  [cpio]=cpio
  [xz]=xz-utils
  [qemu-system-x86_64]=qemu-system-x86
  [qemu-img]=qemu-utils
  [/usr/share/OVMF/OVMF_CODE_4M.fd]=ovmf
  [/usr/share/OVMF/OVMF_CODE_4M.ms.fd]=ovmf
  [/usr/lib/ipxe/qemu/efi-virtio.rom]=ipxe-qemu
  [flock]=util-linux
  [dpkg-deb]=dpkg
)
have() { if [[ $1 == /* ]]; then [ -e "$1" ]; else command -v "$1" >/dev/null 2>&1; fi; }

sudo_cmd=()
apt_ready=
apt() {  # apt-get as root, with the package lists fetched once when they may be missing or stale
  if [ "$(id -u)" -ne 0 ] && [ ${#sudo_cmd[@]} -eq 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "build-guests: need root or sudo for apt-get $*" >&2; exit 1; }
    sudo_cmd=(sudo)
  fi
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get "$@"
}
apt_update() { [ -n "$apt_ready" ] || { apt update -qq; apt_ready=1; }; }

missing=()
for tool in "${!package_of[@]}"; do
  have "$tool" || missing+=("${package_of[$tool]}")
done
if [ ${#missing[@]} -gt 0 ]; then
  command -v apt-get >/dev/null 2>&1 || {
    echo "build-guests: missing ${missing[*]} and no apt-get here: install them with your package manager" >&2
    exit 1
  }
  mapfile -t packages < <(printf '%s\n' "${missing[@]}" | sort -u)
  echo "build-guests: installing ${packages[*]}" >&2
  apt_update
  apt install -y -qq --no-install-recommends "${packages[@]}"
  for tool in "${!package_of[@]}"; do
    have "$tool" || {
      echo "build-guests: '$tool' is still missing after installing ${package_of[$tool]}" >&2
      exit 1
    }
  done
fi

# --- up to date? ---------------------------------------------------------------------------------------------------
outputs=(guest.iso disk.img blank.iso signed.iso
         netboot/boot.ipxe netboot/bootx64.efi netboot/grub/grub.cfg netboot/vmlinuz netboot/initrd.img)
stamp=$outdir/.stamp
want="build-guests $(sha256sum <"${BASH_SOURCE[0]}" | cut -d' ' -f1)"
up_to_date() {
  [ -f "$stamp" ] && [ "$(head -n1 "$stamp")" = "$want" ] || return 1
  local f
  for f in "${outputs[@]}"; do [ -s "$outdir/$f" ] || return 1; done
}
up_to_date && exit 0

mkdir -p "$outdir"
exec 9>"$outdir.lock"
flock 9
up_to_date && exit 0   # another run built it while this one waited
started=$SECONDS
echo "build-guests: building the test guests in $outdir" >&2

work=$(mktemp -d "$outdir/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT

# --- the guest's packages, downloaded (not installed) ---------------------------------------------------------------
debs=$outdir/.debs
mkdir -p "$debs"
apt_download=(apt-get -q)
[ "$(id -u)" -ne 0 ] || apt_download+=(-o APT::Sandbox::User=root)
kernel_package() {  # linux-image-amd64 -> the versioned package it depends on, e.g. linux-image-6.1.0-56-amd64
  apt-cache depends linux-image-amd64 2>/dev/null |
    sed -n 's/^ *Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -n1
}
kpkg=$(kernel_package)
[ -n "$kpkg" ] || { apt_update; kpkg=$(kernel_package); }
[ -n "$kpkg" ] || { echo "build-guests: cannot resolve linux-image-amd64 to a kernel package" >&2; exit 1; }
guest_packages=("$kpkg" busybox-static shim-signed grub-efi-amd64-signed)
declare -A deb_of=()  # package -> the .deb of its candidate version in $debs
print_uris() { "${apt_download[@]}" download --print-uris "${guest_packages[@]}" 2>/dev/null; }
uris=$(print_uris) || { apt_update; uris=$(print_uris); }
while read -r _ file _; do
  for p in "${guest_packages[@]}"; do [[ $file != "${p}_"* ]] || deb_of[$p]=$debs/$file; done
done <<<"$uris"
download() { (cd "$debs" && "${apt_download[@]}" download "${guest_packages[@]}" >/dev/null); }
for p in "${guest_packages[@]}"; do
  [ -n "${deb_of[$p]:-}" ] || { echo "build-guests: apt-get finds no $p to download" >&2; exit 1; }
  [ -s "${deb_of[$p]}" ] || { download; break; }
done
for p in "${guest_packages[@]}"; do
  [ -s "${deb_of[$p]}" ] || { echo "build-guests: download of $p failed: no ${deb_of[$p]}" >&2; exit 1; }
done
for f in "$debs"/*.deb; do  # keep only the versions used now
  keep=
  for p in "${guest_packages[@]}"; do [ "$f" != "${deb_of[$p]}" ] || keep=1; done
  [ -n "$keep" ] || rm -f "$f"
done

pkgroot=$work/pkgs
mkdir -p "$pkgroot"
# the modules the guest loads: the ACPI power button, its /dev/input/event* for acpid, efivarfs for the SecureBoot
# variable (bookworm ships them uncompressed; later releases as .ko.xz, decompressed below: insmod takes plain .ko)
modules=(drivers/acpi/button drivers/input/evdev fs/efivarfs/efivarfs)
patterns=(./boot/vmlinuz-*)
for m in "${modules[@]}"; do patterns+=("*/modules/*/kernel/$m.ko*"); done
dpkg-deb --fsys-tarfile "${deb_of[$kpkg]}" | tar -x -C "$pkgroot" --wildcards "${patterns[@]}"
for p in busybox-static shim-signed grub-efi-amd64-signed; do dpkg-deb -x "${deb_of[$p]}" "$pkgroot"; done
vmlinuz=$(find "$pkgroot/boot" -name 'vmlinuz-*' | head -n1)
busybox=$pkgroot/bin/busybox
[ -e "$busybox" ] || busybox=$pkgroot/usr/bin/busybox
shim=$pkgroot/usr/lib/shim/shimx64.efi.signed
signed_grub=$pkgroot/usr/lib/grub/x86_64-efi-signed/grubx64.efi.signed
for f in "$vmlinuz" "$busybox" "$shim" "$signed_grub"; do
  [ -s "$f" ] || { echo "build-guests: ${f:-the kernel} missing from the packages" >&2; exit 1; }
done

# --- the initramfs --------------------------------------------------------------------------------------------------
root=$work/initramfs
mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,etc/acpi/PWRF,lib/modules,dev,proc,sys,run,tmp,root,var/log}
chmod 1777 "$root/tmp"
chmod 700 "$root/root"
cp "$busybox" "$root/bin/busybox"
while read -r applet; do
  [ "$applet" = /bin/busybox ] || [ -e "$root$applet" ] || ln -s /bin/busybox "$root$applet"
done < <("$busybox" --list-full | sed 's|^|/|')
for m in "${modules[@]}"; do
  ko=$(find "$pkgroot" -path "*/modules/*/kernel/$m.ko*" | head -n1)
  case $ko in
    *.ko) cp "$ko" "$root/lib/modules/" ;;
    *.ko.xz) xz -dc "$ko" >"$root/lib/modules/$(basename "$m").ko" ;;
    *) echo "build-guests: kernel module $m missing or compressed in an unknown way: '$ko'" >&2; exit 1 ;;
  esac
done

cat >"$root/init" <<'EOF'
#!/bin/sh
# KubeVBMC test guest: sets the machine up, says which medium it booted from, then hands over to busybox init.
export PATH=/sbin:/bin:/usr/sbin:/usr/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /run
hostname kubevbmc-guest
# button: the ACPI power button; evdev: its /dev/input/event* for acpid; efivarfs: the SecureBoot variable
for module in /lib/modules/*.ko; do insmod "$module" 2>/dev/null; done
medium=unknown
read -r cmdline </proc/cmdline
for word in $cmdline; do
  case $word in kubevbmc.medium=*) medium=${word#kubevbmc.medium=} ;; esac
done
firmware=bios
secureboot=off
if [ -d /sys/firmware/efi ]; then
  firmware=uefi
  mount -t efivarfs efivarfs /sys/firmware/efi/efivars 2>/dev/null
  var=/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c
  # 4 bytes of attributes, then the value (busybox od -j does not skip on efivarfs: take the last byte)
  [ -r $var ] && [ "$(od -An -tu1 $var | tr -s ' ' '\n' | tail -n1)" = 1 ] && secureboot=on
fi
# quiet the kernel's informational messages from now on so that they do not break the login prompt
dmesg -n 4
for tty in /dev/ttyS0 /dev/tty0; do
  printf 'KUBEVBMC-GUEST: booted from %s\nKUBEVBMC-GUEST: firmware %s secureboot %s\n' \
    "$medium" "$firmware" "$secureboot" >$tty 2>/dev/null
done
exec /sbin/init
EOF
chmod 755 "$root/init"

cat >"$root/etc/inittab" <<'EOF'
::sysinit:/sbin/acpid -l /dev/console
::respawn:/sbin/getty -L 115200 ttyS0 vt100
::respawn:/sbin/getty 38400 tty1 linux
::ctrlaltdel:/sbin/reboot
::shutdown:/bin/sync
EOF
cat >"$root/etc/acpi/PWRF/00000080" <<'EOF'
#!/bin/sh
# the ACPI power button (QEMU's system_powerdown)
exec /sbin/poweroff
EOF
chmod 755 "$root/etc/acpi/PWRF/00000080"
printf 'kubevbmc-guest\n' >"$root/etc/hostname"
printf '\nKubeVBMC test guest\n\n' >"$root/etc/issue"
printf 'root:x:0:0:root:/root:/bin/sh\n' >"$root/etc/passwd"
printf 'root:x:0:\n' >"$root/etc/group"
printf 'root:%s:19000:0:99999:7:::\n' "$("$busybox" mkpasswd -m sha512 guest kubevbmc.guest)" >"$root/etc/shadow"
chmod 600 "$root/etc/shadow"
printf '/bin/sh\n' >"$root/etc/shells"
cat >"$root/etc/profile" <<'EOF'
export PATH=/sbin:/bin:/usr/sbin:/usr/bin
export PS1='guest# '
EOF

newc() {  # NAME MODE RDEVMAJOR RDEVMINOR INODE: a cpio "newc" header of an entry without data (a device node, trailer)
  local n=$((${#1} + 1))
  printf '070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%s\0' \
    "$5" "$2" 0 0 1 0 0 0 0 "$3" "$4" "$n" 0 "$1"
  head -c $(((4 - (110 + n) % 4) % 4)) /dev/zero
}
initrd=$work/initrd.img
{
  (cd "$root" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet)
  # the kernel opens /dev/console before /init runs (devtmpfs is mounted later): a node made without mknod
  newc dev/console $((8#020600)) 5 1 $((0x7fff0000))
  newc TRAILER!!! 0 0 0 0
} | xz -9 --check=crc32 >"$initrd"

# --- the kernel command line and GRUB's configuration ---------------------------------------------------------------
cmdline() { printf 'console=tty0 console=ttyS0,115200 kubevbmc.medium=%s' "$1"; }
grub_cfg() {  # MEDIUM KERNEL INITRD
  cat <<EOF
insmod all_video
if [ "\$grub_platform" = pc ]; then
  # UEFI firmware already mirrors its console to the serial line
  serial --unit=0 --speed=115200
  terminal_input serial console
  terminal_output serial console
fi
set timeout=0
set default=0
menuentry 'KubeVBMC test guest ($1)' {
  echo 'kubevbmc-grub: loading the kernel ($1)'
  linux $2 $(cmdline "$1")
  initrd $3
}
EOF
}

# --- guest.iso and disk.img: grub-mkrescue, BIOS + UEFI hybrid -----------------------------------------------------
grub_modules="linux normal configfile echo test search search_fs_uuid search_fs_file search_label iso9660 fat serial
terminal all_video boot sleep part_acorn part_amiga part_apple part_bsd part_dfly part_dvh part_gpt part_msdos part_plan
part_sun part_sunpc"
rescue() {  # MEDIUM OUTPUT
  local tree=$work/tree-$1
  mkdir -p "$tree/boot/grub"
  cp "$vmlinuz" "$tree/boot/vmlinuz"
  cp "$initrd" "$tree/boot/initrd.img"
  grub_cfg "$1" /boot/vmlinuz /boot/initrd.img >"$tree/boot/grub/grub.cfg"
  printf 'KubeVBMC test guest (%s)\n' "$1" >"$tree/README.txt"
  grub-mkrescue --compress=xz --fonts= --locales= --themes= --install-modules="${grub_modules//$'\n'/ }" \
    -o "$2" "$tree" -- -volid "KUBEVBMC_${1^^}" 2>"$work/mkrescue-$1.log" ||
    { cat "$work/mkrescue-$1.log" >&2; exit 1; }
}
iso_uuid() {  # what GRUB calls the ISO's UUID: the volume's modification time (to 1/100 s, from grub-mkrescue's clock)
  dd if="$1" bs=1 skip=$((32768 + 830)) count=16 2>/dev/null
}
rescue iso "$work/guest.iso"
rescue disk "$work/disk.img"
# GRUB finds its files by that UUID, which grub-mkrescue takes from the time of its run to the second: two images
# attached to one VM must not share it, or the one booted could read the other's grub.cfg
while [ "$(iso_uuid "$work/disk.img")" = "$(iso_uuid "$work/guest.iso")" ]; do
  sleep 1
  rescue disk "$work/disk.img"
done

# --- blank.iso: ISO 9660 with a file, no boot record ----------------------------------------------------------------
mkdir -p "$work/tree-blank"
printf 'KubeVBMC blank medium: not bootable\n' >"$work/tree-blank/README.txt"
xorriso -as mkisofs -quiet -volid KUBEVBMC_BLANK -o "$work/blank.iso" "$work/tree-blank" 2>"$work/blank.log" ||
  { cat "$work/blank.log" >&2; exit 1; }

# --- signed.iso: UEFI-only, shim -> Debian's signed GRUB -> Debian's signed kernel --------------------------------
# The El Torito EFI image (FAT) holds shim as the removable-media loader and Debian's signed GRUB beside it. That GRUB
# is monolithic, its prefix /EFI/debian on the device it was loaded from, which GRUB sees as the whole CD (ISO 9660,
# not the FAT image); failing that it looks for /.disk/info and reads /boot/grub/grub.cfg there, as Debian's CDs do.
# So grub.cfg, the kernel and the initramfs are in the ISO 9660 tree.
tree=$work/tree-signed
esp=$tree/efi.img
mkdir -p "$tree/EFI/debian" "$tree/boot/grub" "$tree/.disk"
size_kib=$(( ($(stat -c %s "$shim") + $(stat -c %s "$signed_grub")) / 1024 + 512 ))
mkfs.vfat -C -n KUBEVBMCESP "$esp" "$size_kib" >/dev/null
export MTOOLS_SKIP_CHECK=1
mmd -i "$esp" ::/EFI ::/EFI/BOOT
mcopy -i "$esp" "$shim" ::/EFI/BOOT/BOOTX64.EFI
mcopy -i "$esp" "$signed_grub" ::/EFI/BOOT/grubx64.efi
grub_cfg signed-iso /vmlinuz /initrd.img >"$tree/EFI/debian/grub.cfg"
cp "$tree/EFI/debian/grub.cfg" "$tree/boot/grub/grub.cfg"
printf 'KubeVBMC test guest (signed-iso)\n' >"$tree/.disk/info"
cp "$vmlinuz" "$tree/vmlinuz"
cp "$initrd" "$tree/initrd.img"
xorriso -as mkisofs -quiet -r -volid KUBEVBMC_SIGNED -e efi.img -no-emul-boot -o "$work/signed.iso" "$tree" \
  2>"$work/signed.log" || { cat "$work/signed.log" >&2; exit 1; }

# --- netboot/: the TFTP root --------------------------------------------------------------------------------------
net=$work/netboot
mkdir -p "$net/grub"
cp "$vmlinuz" "$net/vmlinuz"
cp "$initrd" "$net/initrd.img"
cat >"$net/boot.ipxe" <<EOF
#!ipxe
echo kubevbmc-ipxe: loading the kernel (network)
kernel vmlinuz initrd=initrd.img $(cmdline network)
initrd initrd.img
boot
EOF
grub_cfg network '(tftp)/vmlinuz' '(tftp)/initrd.img' >"$net/grub/grub.cfg"
grub-mkimage -O x86_64-efi -p '(tftp)/grub' -o "$net/bootx64.efi" \
  efinet tftp net linux normal configfile echo test serial terminal boot all_video sleep

# --- install ------------------------------------------------------------------------------------------------------
rm -f "$stamp"
mkdir -p "$outdir/netboot/grub"
for f in "${outputs[@]}"; do mv -f "$work/$f" "$outdir/$f"; done
{
  echo "$want"
  for p in "${guest_packages[@]}"; do basename "${deb_of[$p]}"; done
} >"$work/stamp"
mv -f "$work/stamp" "$stamp"
echo "build-guests: built in $((SECONDS - started)) s" >&2
